"""Solutions to chapter 9's exercises, for instructors (9.3 and 9.4: chapter 9b)."""


# --- chapter 9b ---

def load_sharded(model, optimizer, path):
    """9.3: state dicts of this group's shapes (the optimizer's states created), filled in
    place from the 4-rank files, then handed back to the model and the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def predict_collectives(blocks, micro_batches, reshard_after_forward):
    """9.4: every micro-batch gathers every block for its forward, and again for its
    backward when the forward resharded it; only the last micro-batch reduce-scatters,
    once per block (the root holds no parameters of its own: no unit of its own)."""
    per_micro_batch = blocks * (2 if reshard_after_forward else 1)
    return micro_batches * per_micro_batch, blocks

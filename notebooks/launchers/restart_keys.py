"""What a restarted rank finds in torchrun's store: the dead attempt's notes.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 restart_keys.py
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 \\
        --max-restarts=1 restart_keys.py

The first attempt joins the group as any script does, with a plain
init_process_group("gloo"), and all-reduces once; then its rank 1 fails, and torchrun
restarts both ranks. A restarted rank first looks into the store that torchrun's agent
hosts for the workers (TORCHELASTIC_USE_AGENT_STORE=True) for the note gloo's rendezvous
left there for rank 0, its address, and then joins through a PrefixStore named after the
attempt (TORCHELASTIC_RESTART_COUNT): a clean slate in the same store.

The first attempt's note is still there: torch 2.13's agent keeps the workers' store across
restarts and adds no prefix per attempt (pytorch/pytorch#135712). A plain
init_process_group would read it and might dial the dead rank 0, depending on which rank
writes first. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (c10d rendezvous, which
--standalone is) the workers host a new store in every attempt, and a plain
init_process_group is safe in each.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
RANK, WORLD_SIZE = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
TIMEOUT = timedelta(seconds=30)
# Where gloo's rendezvous leaves rank 0's address: the default group ("default_pg") number
# 0, its device's part ("/cpu//0"), then the rank (chapter 2 met these names).
RANK_0_NOTE = "default_pg/0//cpu//0/0"
agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"

if ATTEMPT == 0 or not agent_store:
    dist.init_process_group("gloo", timeout=TIMEOUT)  # as a script that knows no restarts
else:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          WORLD_SIZE, is_master=False, timeout=TIMEOUT)
    there = store.check([RANK_0_NOTE])
    # The keys of earlier attempts (the other rank of this one may already have written its
    # own, under this attempt's prefix: those are left out).
    old = sorted(key for key in store.list_keys() if not key.startswith(f"attempt_{ATTEMPT}"))
    sys.stdout.write(f"attempt {ATTEMPT + 1}, rank {RANK}, before joining: the store holds "
                     f"{old}; rank 0's note of attempt 1 "
                     f"{'is still there' if there else 'is gone'}\n")
    sys.stdout.flush()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{ATTEMPT}", store),
                            rank=RANK, world_size=WORLD_SIZE, timeout=TIMEOUT)

total = torch.ones(1)
dist.all_reduce(total)
sys.stdout.write(f"attempt {ATTEMPT + 1}, rank {RANK}: joined, all_reduce gave "
                 f"{total.item():g}\n")
sys.stdout.flush()
if ATTEMPT == 0 and RANK == 1:
    raise SystemExit("rank 1 fails after attempt 1's all_reduce")
dist.destroy_process_group()

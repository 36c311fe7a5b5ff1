"""The picture language of the kit: every rank's tensor, and where each value came from.

One rule runs through every picture: **each rank has its own colour, and a cell's colour
says whose data it holds**. Rank 2's values are drawn in rank 2's colour wherever they end
up, so after a gather, a scatter or an all_to_all a learner sees at a glance which values
moved where. A value combined from several ranks (the result of a reduction) is striped
in the colours of all the ranks it came from; an empty buffer (not yet received) is white.

Each panel is one rank: its title in the rank's colour, its tensor as a grid of cells with
the values written in them (1-D tensors as a row, 2-D as a grid). The pictures, by family:

- tensors (`tensors`): `show_ranks`, `show_before_after`, `show_steps`, `show_transfers`,
  `show_inbox`: each rank's tensor, before and after, with arrows for what moved;
  `show_ring`: a ring all-reduce, a row per step;
- topology (`topology`): `show_cluster`, `show_launch`, `show_mesh`: nodes and their
  devices, processes as a launcher placed them, a 2-D mesh; `show_agents`,
  `show_nesting`: torchrun's agents, workers and store, and launchers started inside
  launchers, with the variable that traps a script drawn in red;
- rendezvous (`rendezvous`): `show_store`, `show_rendezvous`, `show_leftover`: a store's
  keys, the rendezvous drawn from the ranks' sockets, and a store left over by a dead run
  read by the next one;
- data (`data`): `show_digits`, `show_sampler`, `show_deal`: MNIST digits, a sampler's
  split, and how it deals the shuffled, padded indices out;
- time (`timeline`): `show_timeline` (with `Span`), `show_flight`: what each rank did when,
  and the collectives its flight recorder kept; `show_overlap`: computation and
  communication side by side on each rank (DDP's backward and its buckets), every span named;
  `show_ddp_step`: one DDP step on each rank, in order (a schematic,
  not measured);
- bars (`bars`): `show_bars`, `show_buckets`: measured quantities, DDP's buckets by bytes;
- curves (`curves`): `LossCurves`, each rank's training loss and their average, drawn live
  in the cell while the ranks train;
- memory (`memory`): `show_memory`, each rank's bytes as a stacked bar (parameters,
  gradients, optimizer states, activations told apart by shades of the rank's colour), a
  group of bars per strategy (DDP, ZeRO-1/2/3, FSDP2), with the Playbook's prediction
  beside them; `show_memory_breakdown`: one rank's bar, each part named with its share;
- shards (`shards`): `show_shards`, which rank holds which shard of which tensor at each
  moment of a step (own, gathered copy, not held, freed); `show_dtensor`, a DTensor's
  global tensor and each rank's local shard for placements such as Shard(0) on a mesh;
- placements (`placements`): `show_tp_flow`, an MLP block split by tensor (and sequence)
  parallelism, a row per rank: which weight slice each holds, the partial sums, and the
  one collective where the ranks meet;
- schedules (`schedules`): `show_schedule`, a pipeline step with one lane per stage, each
  micro-batch's forward and backward from real timestamps (and an ideal schedule beside it),
  the idle time (the bubble) grey; `idle_share`, each stage's idle share of the step;
- routing (`routing`): `show_routing`, a mixture-of-experts layer's tokens flowing from
  each rank to the experts (and to "dropped"); `show_expert_load`, rows per expert from
  each rank against the capacity, the dropped ones hatched;
- links (`links`): `show_group_traffic`, the ranks of a 2-D mesh joined by the process
  groups recorded calls ran on, each link labelled with its calls and bytes sent;
- scores (`scores`): `show_scores`, attention's query-key scores, each in the colour of
  the rank that computes it and labelled with the ring step at which it does (context
  parallelism: contiguous against zig-zag);
- plans (`plans`): `show_plan`, the planner's prediction for one layout or several: memory
  per GPU by category against the GPU's memory, the step split into compute, exposed
  communication and bubble.

They all draw with the shared primitives: the palette (`palette`: a colour always means a
rank), what a cell holds (`cells`), the canvas (`canvas`: inches, panels, arrows, legends)
and the PNG a notebook shows (`png`).

Functions take plain tensors, arrays or lists (no pool needed, so they are easy to test) and
return a `matplotlib.figure.Figure`; in a notebook, a cell ending with one shows it. Figures
are built without pyplot, so they are never shown twice and never accumulate. Sizes are
fixed by the content (cells are about 0.45 inch), so pictures look the same everywhere.
"""

from __future__ import annotations

from ddplab.viz.bars import show_bars, show_buckets
from ddplab.viz.canvas import CELL, FONT, MAX_WIDTH
from ddplab.viz.cells import EMPTY_BUFFER, Owner, as_grid, format_value, owner_grid
from ddplab.viz.curves import LossCurves
from ddplab.viz.data import show_deal, show_digits, show_sampler
from ddplab.viz.links import show_group_traffic
from ddplab.viz.memory import show_memory, show_memory_breakdown
from ddplab.viz.palette import COMBINED, EMPTY, PALETTE, line_color, rank_color, text_color, tint
from ddplab.viz.placements import show_tp_flow
from ddplab.viz.plans import show_plan
from ddplab.viz.png import png_bytes, screen_size
from ddplab.viz.rendezvous import show_leftover, show_rendezvous, show_store
from ddplab.viz.routing import show_expert_load, show_routing
from ddplab.viz.schedules import idle_share, show_schedule
from ddplab.viz.scores import show_scores
from ddplab.viz.shards import show_dtensor, show_shards
from ddplab.viz.tensors import (
    show_before_after,
    show_inbox,
    show_ranks,
    show_ring,
    show_steps,
    show_transfers,
)
from ddplab.viz.timeline import (
    Span,
    show_ddp_step,
    show_flight,
    show_overlap,
    show_timeline,
)
from ddplab.viz.topology import (
    show_agents,
    show_cluster,
    show_launch,
    show_mesh,
    show_nesting,
)

__all__ = [
    "CELL", "COMBINED", "EMPTY", "EMPTY_BUFFER", "FONT", "MAX_WIDTH", "PALETTE", "LossCurves",
    "Owner", "Span", "as_grid", "format_value", "idle_share", "line_color", "owner_grid",
    "png_bytes", "rank_color", "screen_size", "show_agents", "show_bars",
    "show_before_after", "show_buckets", "show_cluster", "show_ddp_step", "show_deal",
    "show_digits", "show_dtensor", "show_expert_load",
    "show_flight", "show_group_traffic", "show_inbox", "show_launch", "show_leftover",
    "show_memory", "show_memory_breakdown", "show_mesh", "show_nesting", "show_overlap",
    "show_plan", "show_ranks", "show_rendezvous", "show_ring", "show_routing",
    "show_sampler", "show_schedule", "show_scores", "show_shards", "show_steps", "show_store",
    "show_timeline", "show_tp_flow", "show_transfers", "text_color", "tint",
]

"""The planner's parts: `shapes` (model, cluster, layout and their presets), `predict`
(`plan`, `search`, `calibrated`), `published` (the papers' runs it is checked against) and
`cpu` (the kit's own runs on the pool's ranks; the only part that imports torch).

The public face is `ddplab.planner` (what `ddplab plan` and the chapter import): it holds
the formulas' docstring and re-exports `shapes` and `predict`."""

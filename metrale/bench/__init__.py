"""`metrale bench` and its parts: `shapes` (published model shapes with random weights), `timing`
(device timing, bandwidth, weight bytes), `curves` (decode step and verify cost curve), `e2e`
(end-to-end runs at a replayed acceptance), `drafter` (a real drafter on a checkpoint),
`acceptance` (per-position acceptance on held-out text), `command` (the command: run, table, plot),
and the reusable tools run as modules: `profile_step`, `profile_e2e`, `serve_load`.
"""

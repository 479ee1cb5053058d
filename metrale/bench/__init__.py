"""`metrale bench` and its parts: `shapes` (published model shapes with random weights), `timing`
(the roofline: bandwidth and weight bytes; step and verify curves are the engine's own, in
`engine/calibrate.py`), `forced` (bench-only forced acceptance), `e2e` (end-to-end runs at a
replayed or forced acceptance), `drafter` (a real drafter on a checkpoint), `acceptance`
(per-position acceptance on held-out text), `command` (the command: run, table, plot), and the
reusable tools run as modules: `profile_step`, `profile_e2e`, `serve_load`.
"""

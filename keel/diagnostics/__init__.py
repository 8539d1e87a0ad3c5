"""Collapse diagnostics: token telemetry, structural states, episode metrics, detectors over the
metric history, run classification (`diagnose`) and KG error decomposition. All pure functions
over tensors, trajectories and metric lines; the trainer wires them in."""

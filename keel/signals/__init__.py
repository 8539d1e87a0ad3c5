"""Paper A's supervision signals (and paper B's self-distillation): objects with hooks the loop calls.

Each signal changes *which data* goes into *which loss* at *which step*; none owns a loop:
- keel.signals.ops         OPS: gold trajectories as GRPO group members (Eq. 4), "add" and "replace"
- keel.signals.hints       hint-based guidance: hints while sampling only (HINT tokens never trained)
- keel.signals.ets         ETS: buffer of all-failed prompts → gold single-step SFT examples
- keel.signals.reflection  PRS: rule / LLM analyzers, reflection examples (REFLECTION targets)
- keel.signals.restem      ReST-EM self-distillation: select good episodes, relabel as SFT targets
- keel.signals.schedule    synchronous vs interleaved supervision as data (the `signals:` section is in keel.config)
- keel.signals.base        what a signal is to the loop: `Signal` and its hooks; keel.signals.state runs them
"""

"""Function-calling environments: BFCL-V3 multi-turn and ACEBench, never executing model text.

- keel.fc.parse      literal-only call parsing (Hermes JSON, Python-call lists, <TOOLCALL> lists)
                     and the canonical re-serialisation that alone reaches bfcl-eval's eval()
- keel.fc.bfcl       BfclEnv / BfclEpisode on bfcl-eval's data, simulators and checker; bfcl_check;
                     single-turn AST categories (BfclSingleTurnEnv, check_single_turn)
- keel.fc.acebench   ACEBench loader (released format), scorer, AceBenchEnv
- keel.fc.learnable  seeded easy multi-turn tasks on the same simulators (LearnableEnv)
- keel.fc.policies   oracle / null text policies and run_fc_episode
- keel.fc.evaluate   evaluate_fc(...) -> summary.json + results.jsonl, ID / OOD splits
"""

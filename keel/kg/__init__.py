"""Knowledge-graph tool use: a triple store behind paper B's four verbs, data, loaders."""

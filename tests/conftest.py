import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer): the tiny random Llama with SmolLM2's tokenizer, seeded."""
    from keel.models import load_model

    return load_model("tiny", seed=0)


# Tests use tiny models: one thread avoids oversubscribing small GEMMs (4× faster on a busy
# 2-core machine, measured: 2.6 s vs 10.8 s for the same rollout).
import torch  # noqa: E402

torch.set_num_threads(1)

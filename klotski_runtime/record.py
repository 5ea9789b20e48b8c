"""Record routing traces from a local Hugging Face MoE checkpoint (never from the hub).

Forward hooks on each decoder layer's router (`layers[i].mlp.gate`) capture, for every token
the model processes, the router's own top-k expert ids and weights (transformers 5 routers return
`(logits, top_k_weights, top_k_index)`; a router that returns only logits is top-k'ed here the
way transformers' routers do it: softmax, top-k, renormalised unless the config's
`norm_topk_prob` is false). Each text is one sequence: prefill of
its first `max_tokens` tokens, then greedy decoding of `gen_len` tokens, each of which is fed
back once, so a sequence holds `prompt + gen_len` tokens.
"""

from __future__ import annotations

import datetime as _dt
import platform
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence, cast

import numpy as np
import torch

from klotski_sim.files.textfile import read_text
from klotski_sim.util.errors import KlotskiError
from klotski_sim.workload.model import PRESETS
from klotski_sim.workload.trace import Trace, TraceError


class RecordError(KlotskiError):
    """A checkpoint or input that cannot be recorded from; the message says why."""


def read_texts(path: str | Path) -> list[str]:
    """Sequences are the blank-line separated paragraphs of a UTF-8 text file."""
    path = Path(path)
    raw = read_text(
        path, "text file", RecordError
    )  # (a device or a pipe is refused: /dev/zero would be read till memory runs out)
    texts = [p.strip() for p in raw.split("\n\n") if p.strip()]
    if not texts:
        raise RecordError(f"{path}: no text")
    return texts


def load_moe_model(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | None = None):
    """Load a causal-LM MoE checkpoint from a local directory; returns (model, tokenizer or None)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():  # (else: "no config.json" of a folder that is not there)
        raise RecordError(
            f"{model_dir}: {'not a folder' if model_dir.exists() else 'no such folder'}: give a Hugging "
            f"Face checkpoint directory"
        )
    if not (model_dir / "config.json").is_file():
        raise RecordError(f"{model_dir}: no config.json — not a Hugging Face checkpoint directory")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RecordError(f"--device {device}: torch sees no CUDA GPU on this machine")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a config it cannot read
        raise RecordError(f"{model_dir / 'config.json'}: transformers cannot read it ({_first_line(err)})") from None
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not num_experts or not getattr(config, "num_experts_per_tok", None):
        raise RecordError(
            f"{model_dir}: {config.model_type!r} is not a mixture-of-experts model "
            f"(config has no num_experts / num_experts_per_tok)"
        )
    try:
        with transformers_quiet():
            # (transformers annotates the model alone; with output_loading_info it returns (model, info))
            model, loading = cast(
                "tuple[torch.nn.Module, dict[str, Any]]",
                AutoModelForCausalLM.from_pretrained(
                    model_dir,
                    local_files_only=True,
                    output_loading_info=True,
                    dtype=dtype or (torch.float32 if device == "cpu" else torch.bfloat16),
                ),
            )
    except Exception as err:  # noqa: BLE001 - a bad config value or weights file surfaces as many kinds
        raise RecordError(f"{model_dir}: cannot load the checkpoint ({_first_line(err)})") from None
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # (transformers draws them at random and says so in a table: the trace would be a random model's)
        raise RecordError(
            f"{model_dir}: the checkpoint lacks {len(missing)} of the model's weights "
            f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); transformers would draw "
            f"them at random, and the routing recorded would be a random model's"
        )
    model.to(device).eval()
    tokenizer = None
    if any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer


@contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' progress bars and load report off while it loads or saves a checkpoint: this
    command's output is its own lines (a missing weight is refused by the caller, in one line)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def check_model_name(model_name: str | None, num_experts: int, top_k: int, num_layers: int, where: Path) -> None:
    """A trace named after a klotski-sim preset must have the preset's shape (it is replayed by name)."""
    spec = PRESETS.get(model_name or "")
    if spec is None:
        return
    got, want = (num_experts, top_k, num_layers), (spec.num_experts, spec.top_k, spec.num_layers)
    if got != want:
        raise RecordError(
            f"--model-name {model_name}: {where} has {num_experts} experts, top-{top_k}, {num_layers} "
            f"layers; preset {model_name!r} has {spec.num_experts}, top-{spec.top_k}, {spec.num_layers}"
        )


def _routers(model) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise RecordError(f"{type(model).__name__}: cannot find model.layers")
    routers = []
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is None:
            raise RecordError(
                f"{type(model).__name__}: layer {i} has no mlp.gate router (dense layer?); "
                "only all-MoE models are supported"
            )
        routers.append(gate)
    return routers


def cache_protocol(model):
    """transformers renamed `past_key_values` to `cache` (5.x); speak whichever this one knows.
    Returns (keyword to pass the cache in, function reading the cache out of an output)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def read(output):
        return getattr(output, name, None) if getattr(output, name, None) is not None else output.past_key_values

    return name, read


def tokenize(text: str, tokenizer, vocab_size: int, max_tokens: int) -> list[int]:
    """Token ids of `text`; without a tokenizer, its UTF-8 bytes modulo the vocabulary."""
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    else:
        ids = [b % vocab_size for b in text.encode("utf-8")]
    return list(ids[:max_tokens])


@torch.no_grad()
def record(
    model_dir: str | Path,
    texts: Sequence[str],
    max_tokens: int = 512,
    gen_len: int = 32,
    device: str = "cpu",
    dataset: str = "unknown",
    model_name: str | None = None,
) -> Trace:
    """Run prefill + greedy decode over each text and return the routing of every token."""
    if max_tokens < 1 or gen_len < 0:
        raise RecordError("max_tokens must be >= 1 and gen_len >= 0")
    model, tokenizer = load_moe_model(model_dir, device)
    config = model.config
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and max_tokens + gen_len > positions:  # (refused here, not after hours of decode)
        raise RecordError(
            f"--max-tokens {max_tokens} + --gen-len {gen_len} = {max_tokens + gen_len} tokens, but "
            f"{Path(model_dir).name}'s config allows {positions} positions (max_position_embeddings)"
        )
    top_k = int(config.num_experts_per_tok)
    num_experts = int(getattr(config, "num_local_experts", None) or config.num_experts)
    routers = _routers(model)
    check_model_name(model_name, num_experts, top_k, len(routers), Path(model_dir))
    captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in routers]
    fallback = [False]
    renormalise = bool(getattr(config, "norm_topk_prob", True))  # Mixtral's config has none: it always does

    def hook(layer: int):
        def capture(module, inputs, output):
            if isinstance(output, tuple) and len(output) >= 3:
                weights, index = output[1], output[2]
            else:  # older routers return only logits: top-k them as the model's router does
                logits = output[0] if isinstance(output, tuple) else output
                probs = torch.softmax(logits.float(), dim=-1)
                weights, index = torch.topk(probs, top_k, dim=-1)
                if renormalise:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                fallback[0] = True
            captured[layer].append((index.reshape(-1, top_k).cpu(), weights.reshape(-1, top_k).float().cpu()))

        return capture

    cache_arg, kv_cache = cache_protocol(model)
    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    experts, weights, lengths, prompt_lens = [], [], [], []
    try:
        for text in texts:
            ids = tokenize(text, tokenizer, config.vocab_size, max_tokens)
            if not ids:
                continue
            for c in captured:
                c.clear()
            input_ids = torch.tensor([ids], device=device)
            out = model(input_ids=input_ids, use_cache=True)
            for _ in range(gen_len):  # feed each generated token back once
                nxt = out.logits[:, -1:].argmax(dim=-1)
                out = model(input_ids=nxt, use_cache=True, **{cache_arg: kv_cache(out)})
            idx = torch.stack([torch.cat([c[0] for c in layer]) for layer in captured], dim=1)  # [T, L, k]
            w = torch.stack([torch.cat([c[1] for c in layer]) for layer in captured], dim=1)
            experts.append(idx.numpy().astype(np.int16))
            weights.append(w.numpy().astype(np.float16))
            lengths.append(idx.shape[0])
            prompt_lens.append(len(ids))
    finally:
        for h in handles:
            h.remove()
    if not experts:
        raise RecordError("no text produced any tokens")
    import transformers

    meta = {
        "model": model_name or Path(model_dir).name,
        "num_experts": num_experts,
        "top_k": top_k,
        "num_layers": len(routers),
        "dataset": dataset,
        "license": "same as the recorded text and checkpoint",
        "recorder": f"klotski_runtime.record (transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{'router top-k recomputed from logits' if fallback[0] else 'router outputs'}, "
        f"{'tokenizer' if tokenizer is not None else 'byte-level ids (no tokenizer in checkpoint)'})",
        "source": f"record:{Path(model_dir).name}",
        "hf_model_type": config.model_type,
        "recorded_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "gen_len": gen_len,
        "max_tokens": max_tokens,
    }
    try:
        return Trace(
            np.concatenate(experts),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            np.asarray(prompt_lens, dtype=np.int32),
            meta,
            np.concatenate(weights),
        )
    except TraceError as err:
        # (NaN weights in the checkpoint make NaN gate probabilities: say it is the file's problem, not the trace's)
        broken = next((name for name, tensor in model.named_parameters() if not torch.isfinite(tensor).all()), None)
        if broken is not None:
            raise RecordError(
                f"{model_dir}: the checkpoint's tensor {broken} (as transformers names it) holds NaN "
                f"or infinite values: its routing cannot be recorded"
            ) from None
        raise RecordError(f"recorded routing is inconsistent: {err}") from None


def save_tiny_mixtral(
    path: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    num_experts: int = 4,
    hidden: int = 64,
    ffn: int = 128,
    vocab: int = 256,
) -> Path:
    """A tiny random Mixtral checkpoint (shapes of the `tiny-mixtral` preset) for tests and demos."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(config)
    return _saved(model, path)


def _saved(model: Any, path: str | Path) -> Path:
    """A tiny checkpoint written to `path` without transformers' progress bar."""
    with transformers_quiet():
        model.save_pretrained(path)
    return Path(path)


def _randomise_norms(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every RMSNorm weight drawn around 1 (transformers initialises them to ones), so a comparison
    against the model sees which norm vector is applied to what."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))


def save_tiny_qwen3_moe(
    path: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    num_experts: int = 8,
    hidden: int = 64,
    ffn: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    vocab: int = 256,
    norm_topk_prob: bool = True,
    **config: Any,
) -> Path:
    """A tiny random Qwen3-MoE checkpoint: top-2, q/k norm per head, head_dim not hidden/heads (as in
    Qwen3-30B-A3B), RMSNorm weights randomised. `config`: further Qwen3MoeConfig keys (mlp_only_layers...)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * ffn,
        moe_intermediate_size=ffn,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **config,
    )
    model = Qwen3MoeForCausalLM(cfg)
    _randomise_norms(model, torch.Generator().manual_seed(seed))
    return _saved(model, path)


def save_tiny_olmoe(
    path: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    num_experts: int = 8,
    hidden: int = 64,
    ffn: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    norm_topk_prob: bool = False,
    **config: Any,
) -> Path:
    """A tiny random OLMoE checkpoint: top-2, q/k norm over the whole projections, top-k weights not
    renormalised (OLMoE-1B-7B's norm_topk_prob), RMSNorm weights randomised. `config`: further
    OlmoeConfig keys (clip_qkv...)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    cfg = OlmoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_experts=num_experts,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=None,
        eos_token_id=None,
        **config,
    )
    model = OlmoeForCausalLM(cfg)
    _randomise_norms(model, torch.Generator().manual_seed(seed))
    return _saved(model, path)

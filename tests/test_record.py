"""Recording routing from a local Hugging Face checkpoint (a tiny random Mixtral)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from klotski_runtime.record import (  # noqa: E402
    RecordError,
    load_moe_model,
    read_texts,
    record,
    save_tiny_mixtral,
)
from klotski_sim.workload.model import get_model  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog.\n\nExperts stream over PCIe while the GPU waits.\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_mixtral(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


def test_recorded_topk_equals_the_routers_own(checkpoint, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    texts = read_texts(tmp_path / "t.txt")
    trace = record(checkpoint, texts, max_tokens=32, gen_len=4, model_name="tiny-mixtral")
    trace.check_model(get_model("tiny-mixtral"))
    assert trace.num_sequences == 2 and trace.lengths.tolist() == [32 + 4, min(32, len(texts[1].encode())) + 4]
    # Recompute the routing with an independent full forward of the same token sequence.
    model, _ = load_moe_model(checkpoint)
    with torch.no_grad():
        for i in range(trace.num_sequences):
            seq = trace.sequence(i)
            prompt = [b % 256 for b in texts[i].encode()][:32]
            ids = list(prompt)
            out = model(input_ids=torch.tensor([ids]))
            for _ in range(4):
                ids.append(int(out.logits[0, -1].argmax()))
                out = model(input_ids=torch.tensor([ids]))
            full = model(input_ids=torch.tensor([ids]), output_router_logits=True)
            for layer, logits in enumerate(full.router_logits):
                probs = torch.softmax(logits.float(), dim=-1)
                top = torch.topk(probs, 2, dim=-1).indices.numpy()
                assert np.array_equal(np.sort(top, axis=1), np.sort(seq[:, layer, :], axis=1)), layer


def test_record_errors(tmp_path, checkpoint):
    with pytest.raises(RecordError, match="no config.json"):
        record(tmp_path, ["x"])
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(RecordError, match="no text"):
        read_texts(tmp_path / "empty.txt")


def test_a_checkpoint_with_nan_weights_is_named_with_its_tensor(tmp_path, checkpoint):
    """A router weight of NaN was said as `recorded routing is inconsistent: trace: weights must be
    finite ...`, the trace's problem rather than the checkpoint's."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    tensors = load_file(broken / "model.safetensors")
    gate = next(name for name in tensors if name.endswith("moe.gate.weight"))
    tensors[gate] = torch.full_like(tensors[gate], float("nan"))
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(
        RecordError,
        match=f"{broken}: the checkpoint's tensor .*gate.weight \\(as transformers names "
        f"it\\) holds NaN or infinite values",
    ):
        record(broken, [TEXT], max_tokens=8, gen_len=1)


@pytest.mark.parametrize("kind", ["olmoe", "qwen2_moe"])
def test_records_other_moe_families(kind, tmp_path):
    """OLMoE and Qwen-MoE routers sit at the same place (layers[i].mlp.gate) in transformers."""
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    if kind == "olmoe":
        config = transformers.OlmoeConfig(intermediate_size=16, **common)
        model = transformers.OlmoeForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32, **common
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    model.save_pretrained(tmp_path / kind)
    trace = record(tmp_path / kind, ["mixture of experts"], max_tokens=12, gen_len=2)
    assert trace.num_experts == 8 and trace.top_k == 2 and trace.num_layers == 2
    assert trace.lengths.tolist() == [12 + 2] and trace.meta["hf_model_type"] == kind

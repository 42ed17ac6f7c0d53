"""Tests for the sample models in ``samples/`` (tiny configs; big ones only on meta)."""

from __future__ import annotations

import pytest
import torch

from autopar.cli.sources import import_source, load_model, resolve_source
from samples import SAMPLES, Sample, get_sample
from samples.gpt import GPT
from samples.llama import Llama

BATCH = 8
NAMES = sorted(SAMPLES)


@pytest.fixture(params=NAMES)
def sample(request: pytest.FixtureRequest) -> Sample:
    return SAMPLES[request.param]


def _tiny(sample: Sample, seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    model = sample.build("tiny")
    return model, sample.example_batch(model, BATCH, seed=seed)


def test_registry() -> None:
    assert set(SAMPLES) == {"gpt", "llama", "mlp"}
    for name, s in SAMPLES.items():
        assert s.name == name and "tiny" in s.configs
    assert get_sample("gpt") is SAMPLES["gpt"]
    with pytest.raises(KeyError):
        get_sample("nope")
    with pytest.raises(KeyError):
        SAMPLES["gpt"].build("nope")


def test_forward_backward(sample: Sample) -> None:
    model, batch = _tiny(sample)
    assert all(t.shape[0] == BATCH for t in batch)
    loss = model(*batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


def test_deterministic(sample: Sample) -> None:
    (m1, b1), (m2, b2) = _tiny(sample, seed=3), _tiny(sample, seed=3)
    for (k1, v1), (k2, v2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2), k1
    assert all(torch.equal(x, y) for x, y in zip(b1, b2, strict=True))
    _, b3 = _tiny(sample, seed=4)
    assert not torch.equal(b1[0], b3[0])
    # the config (or its name) works in place of the model
    b4 = sample.example_batch("tiny", BATCH, 3)
    assert all(torch.equal(x, y) for x, y in zip(b1, b4, strict=True))


def test_loaded_by_path_like_the_registry(sample: Sample) -> None:
    """The CLI's loader (the file by path, `build`/`example_batch`/`CONFIGS`) builds the
    registry's model and batch, and plans on meta exactly as the samples' own meta path."""
    model, batch = _tiny(sample)
    loaded, loaded_batch = load_model(sample.name, "tiny", BATCH)
    assert type(loaded).__name__ == type(model).__name__
    assert type(loaded) is not type(model)  # its own module, not `samples.<name>`
    for (k1, v1), (k2, v2) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert k1 == k2 and torch.equal(v1, v2), k1
    assert all(torch.equal(x, y) for x, y in zip(batch, loaded_batch, strict=True))
    meta, meta_batch = load_model(sample.name, None, BATCH, meta=True)
    assert all(p.is_meta for p in meta.parameters()) and all(t.is_meta for t in meta_batch)
    assert [tuple(t.shape) for t in meta_batch] == [tuple(t.shape) for t in batch]
    assert import_source(resolve_source(sample.name)).CONFIGS == sample.configs


def test_export_matches_eager(sample: Sample) -> None:
    model, batch = _tiny(sample)
    ep = torch.export.export(model, batch, strict=False)
    with torch.no_grad():
        eager = model(*batch)
        exported = ep.module()(*batch)
    torch.testing.assert_close(exported, eager)


def test_gpt_head_tied() -> None:
    model = SAMPLES["gpt"].build("tiny")
    assert isinstance(model, GPT)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # counted once
    # export keeps two parameter placeholders (wte.weight, lm_head.weight) that alias one tensor
    ep = torch.export.export(model, SAMPLES["gpt"].example_batch(model, 2), strict=False)
    assert ep.state_dict["lm_head.weight"] is ep.state_dict["wte.weight"] is model.wte.weight


def test_llama_untied_gqa() -> None:
    model = SAMPLES["llama"].build("tiny")
    assert isinstance(model, Llama)
    assert model.output.weight is not model.tok_embeddings.weight
    attn = model.layers[0].attention
    assert attn.wk.out_features == attn.wq.out_features // 2  # 2 kv heads for 4 q heads
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert "rope_cos" not in model.state_dict()  # non-persistent


def test_llama_meta_then_materialize() -> None:
    torch.manual_seed(0)
    real = SAMPLES["llama"].build("tiny")
    meta = SAMPLES["llama"].build("tiny", device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights()
    torch.testing.assert_close(meta.rope_cos, real.rope_cos)
    torch.testing.assert_close(meta.rope_sin, real.rope_sin)
    assert torch.isfinite(meta(*SAMPLES["llama"].example_batch(meta, 2)))


@pytest.mark.parametrize(
    ("name", "config", "lo", "hi"),
    [
        ("gpt", "gpt2-124m", 1.2e8, 1.3e8),
        ("gpt", "gpt2-1.5b", 1.5e9, 1.6e9),
        ("llama", "llama3-8b", 7.9e9, 8.1e9),
        ("llama", "llama3-70b", 7.0e10, 7.1e10),
        ("mlp", "large", 2.0e8, 2.3e8),
    ],
)
def test_big_configs_on_meta(name: str, config: str, lo: float, hi: float) -> None:
    sample = SAMPLES[name]
    assert config in sample.configs
    model = sample.build(config, device="meta")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    n_params = sum(p.numel() for p in model.parameters())
    assert lo < n_params < hi, n_params
    batch = sample.example_batch(model, 2, device="meta")
    assert all(t.is_meta for t in batch)

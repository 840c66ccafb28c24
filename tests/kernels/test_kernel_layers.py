"""The kernels inside a model: sibling projections (q/k/v, gate/up) in one kernel call with
the bits of one call each, their fallback when a parent feeds them different inputs, and the
int8-activation path as install() puts it on the layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.device.kernels import cpu_kernels, kernel_layers

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernels_available(),
    reason=f"CPU kernels unavailable here: {cpu_kernels.kernel_status().reason}")


class Attention(nn.Module):
    def __init__(self, dim: int, kv_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_dim, bias=True)  # a bias is added after the product

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention(128, 64)
        self.mlp = Mlp(128, 192)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([self.self_attn(x), self.mlp(x)], axis=-1)


def _quantized_block(seed: int) -> Block:
    mx.random.seed(seed)
    block = Block()
    nn.quantize(block, group_size=32, bits=4)
    mx.eval(block.parameters())
    return block


def _groups(model: nn.Module) -> list[kernel_layers.Siblings]:
    found = {id(m._mlx_providers_siblings): m._mlx_providers_siblings
             for _, m in model.named_modules() if hasattr(m, "_mlx_providers_siblings")}
    return list(found.values())


def test_siblings_run_in_one_call_with_the_bits_of_one_call_each() -> None:
    block = _quantized_block(0)
    installed = kernel_layers.install(block)
    assert installed.sibling_groups == 2
    assert "2 sibling groups in one call each" in installed.describe()
    x = mx.array(np.random.default_rng(0).standard_normal((5, 128)).astype(np.float32))
    fused = block(x)
    for group in _groups(block):
        group.fusing = False
    separate = block(x)
    assert mx.array_equal(fused, separate).item()
    assert all(type(m) is kernel_layers.KernelSiblingLinear
               for m in (block.self_attn.q_proj, block.mlp.up_proj))
    assert type(block.mlp.down_proj) is kernel_layers.KernelQuantizedLinear
    # No parameter was added, copied or changed by the grouping.
    names = {name for name, _ in nn.utils.tree_flatten(block.parameters())}
    assert not any("siblings" in name for name in names)


def test_siblings_fed_different_inputs_compute_each_and_stop_fusing() -> None:
    block = _quantized_block(1)
    reference = _quantized_block(1)
    kernel_layers.install(block)
    attn = block.self_attn
    group = _groups(attn)[0]
    rng = np.random.default_rng(1)
    for _ in range(kernel_layers.Siblings.GIVE_UP_AFTER + 1):
        xs = [mx.array(rng.standard_normal((2, 128)).astype(np.float32)) for _ in range(3)]
        got = [attn.q_proj(xs[0]), attn.k_proj(xs[1]), attn.v_proj(xs[2])]
        want = [reference.self_attn.q_proj(xs[0]), reference.self_attn.k_proj(xs[1]),
                reference.self_attn.v_proj(xs[2])]
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-4)
    assert group.fusing is False  # outputs computed and never asked for: it gave up


def test_int8_is_put_on_every_kernel_layer_where_the_cpu_has_it() -> None:
    block = _quantized_block(2)
    installed = kernel_layers.install(block, int8=True)
    layers = [m for _, m in block.named_modules()
              if isinstance(m, kernel_layers.KernelQuantizedLinear)]
    assert len(layers) == 6
    path = cpu_kernels.int8_path()
    assert installed.int8 == path
    assert all(m._mlx_providers_int8 is bool(path) for m in layers)
    x = mx.array(np.random.default_rng(2).standard_normal((3, 128)).astype(np.float32))
    rounded = block(x)
    plain = _quantized_block(2)
    kernel_layers.install(plain)
    exact = plain(x)
    if not path:
        assert mx.array_equal(rounded, exact).item()
        return
    error = (mx.abs(rounded - exact).max() / mx.abs(exact).max()).item()
    assert 0 < error < 0.05  # rounded activations: close, not the same bits


def test_norm_and_rope_take_the_kernels_inside_a_marked_forward_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """mx.fast.rms_norm and mx.fast.rope are wrapped once per process: a forward of a model
    install() marked runs them on the kernels (one op each, not MLX's ~7 and ~20 CPU ops);
    any other caller in the process still gets MLX's own, bit for bit."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=96, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=50, num_key_value_heads=2, rope_theta=10000.0)
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    tokens = mx.array([[1, 5, 7, 9]])
    before = model(tokens)
    installed = kernel_layers.install(model)
    assert installed.norm_and_rope and "RMSNorm and RoPE" in installed.describe()
    calls = {"rms_norm": 0, "rope": 0}
    for name in calls:
        real = getattr(cpu_kernels, name)

        def counted(*args: object, _name: str = name, _real: object = real,
                    **kwargs: object) -> mx.array:
            calls[_name] += 1
            return _real(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(cpu_kernels, name, counted)
    after = model(tokens)
    assert calls == {"rms_norm": 2 * 2 + 1, "rope": 2 * 2}  # 2 norms and q, k a layer; final
    assert mx.abs(after - before).max().item() < 1e-4
    x = mx.array(np.random.default_rng(3).standard_normal((1, 2, 3, 16)).astype(np.float32))
    outside = mx.fast.rope(x, 16, traditional=False, base=10000.0, scale=1.0, offset=4)
    original = mx.fast.rope.__wrapped__(x, 16, traditional=False, base=10000.0, scale=1.0,
                                        offset=4)
    assert mx.array_equal(outside, original).item()
    assert calls["rope"] == 4  # the call outside a forward did not reach the kernel

"""Policy layers against naive references: KDA chunked vs recurrent, absorbed vs naive MLA,
SiTU-GLU's properties, the MoE expert loop vs a dense reference, routing and routing replay,
and quantile balancing against the sign update."""

import pytest
import torch
import torch.nn.functional as F

from policy.args import KDAArgs, MLAArgs, MoEArgs
from policy.balance import QuantileHistogram, load_imbalance, quantile_bias, sign_update
from policy.kda import KDA, KDAState, _diag_span, kda_chunked, kda_recurrent
from policy.mla import GatedMLA, MLACache
from policy.moe import Activation, LatentMoE, Router, naive_moe, situ_glu, swiglu


def _kda_inputs(dtype, B=2, T=37, H=3, K=8, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    # as strong as the safe gate allows
    logdecay = -5 * torch.rand(B, T, H, K, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, logdecay, beta, S0


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_kda_chunked_equals_recurrent(dtype, tol, chunk):
    q, k, v, g, beta, S0 = _kda_inputs(dtype)  # T=37: partial last chunk for every chunk size
    o_r, S_r = kda_recurrent(q, k, v, g, beta, S0)
    o_c, S_c = kda_chunked(q, k, v, g, beta, S0, chunk_size=chunk)
    assert (o_r - o_c).abs().max().item() <= tol
    assert (S_r - S_c).abs().max().item() <= tol


def test_kda_state_carries_across_calls():
    q, k, v, g, beta, _ = _kda_inputs(torch.float64)
    o_full, S_full = kda_chunked(q, k, v, g, beta, chunk_size=8)
    o1, S1 = kda_chunked(q[:, :21], k[:, :21], v[:, :21], g[:, :21], beta[:, :21], chunk_size=8)
    o2, S2 = kda_recurrent(q[:, 21:], k[:, 21:], v[:, 21:], g[:, 21:], beta[:, 21:], S1)
    assert torch.allclose(torch.cat([o1, o2], 1), o_full, atol=1e-10)
    assert torch.allclose(S2, S_full, atol=1e-10)


def _grads_against_recurrent(fn, inputs):
    """(o, S, every input's gradient) of fn and of the recurrence, for one loss over o and S."""
    out = []
    for f in (kda_recurrent, fn):
        for t in inputs:
            t.grad = None
        o, S = f(*inputs)
        (o.pow(2).sum() + S.sum()).backward()
        out.append((o.detach(), S.detach(), torch.cat([t.grad.flatten() for t in inputs])))
    return out


@pytest.mark.parametrize("chunk", [8, 16, 32, 64])
def test_the_form_chosen_from_the_gate_s_bound_equals_recurrent_without_looking_at_the_data(
    chunk, monkeypatch
):
    """With the safe gate's bound (|g| <= 5) every sub-chunk's diagonal block is factorised, decided
    before the data is seen (no span is computed); chunks longer than 16 are cut into sub-chunks;
    the sequence is cut into segments (here of 16 tokens, so several) for the forward and the
    backward's recompute. Outputs, state and the gradients of every input (the initial state
    included) equal the step-by-step recurrence in fp64; outputs within float tolerance in fp32 and
    from bf16 inputs."""
    from policy import kda as kda_module

    monkeypatch.setattr(kda_module, "_diag_span", lambda *a: pytest.fail("the data was inspected"))
    monkeypatch.setattr(kda_module, "_SEGMENT_ELEMENTS", 16 * 2 * 3 * 8)  # B=2, H=3, K=8: 16 tokens
    assert kda_module.factorisable(chunk, 5.0) and kda_module.factorisable(chunk, None) is None
    inputs = [t.requires_grad_(True) for t in _kda_inputs(torch.float64, T=37)]
    for a, b in zip(
        *_grads_against_recurrent(
            lambda *xs: kda_chunked(*xs, chunk_size=chunk, step_bound=5.0), inputs
        )
    ):
        assert torch.allclose(a, b, atol=1e-9)
    ref_o, ref_S = kda_recurrent(*(t.detach() for t in inputs))
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        o, S = kda_chunked(
            *(t.detach().to(dtype) for t in inputs), chunk_size=chunk, step_bound=5.0
        )
        assert (
            o.dtype == torch.float32
            and (o.double() - ref_o).abs().max() <= tol
            and (S.double() - ref_S).abs().max() <= tol
        )


@pytest.mark.parametrize("bound", [None, 20.0])
def test_strong_unbounded_decay_takes_the_pairwise_diagonal_blocks_and_equals_recurrent(
    bound, monkeypatch
):
    """Decay up to 20 per step (the softplus gate has no bound) would overflow the factorised
    diagonal blocks (8 steps × 20 > 60): without a bound the data's span is measured once per call
    and picks the pairwise form; with a bound too large it is picked statically. Either way outputs,
    state and gradients equal the recurrence."""
    from policy import kda as kda_module

    spans = []
    monkeypatch.setattr(
        kda_module, "_diag_span", lambda *a: spans.append(_diag_span(*a)) or spans[-1]
    )
    q, k, v, _, beta, S0 = _kda_inputs(torch.float64, T=45)
    g = -20 * torch.rand(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs = [t.requires_grad_(True) for t in (q, k, v, g, beta, S0)]
    fn = lambda *a: kda_chunked(*a, chunk_size=32, step_bound=bound)  # noqa: E731
    for a, b in zip(*_grads_against_recurrent(fn, inputs)):
        assert torch.isfinite(b).all() and torch.allclose(a, b, atol=1e-9)
    assert (len(spans) == 1 and spans[0] > 60) if bound is None else spans == []


@pytest.mark.parametrize("chunk", [16, 64])
def test_bf16_operands_are_kept_in_bf16_and_computed_as_fp32_math_on_their_values(
    chunk, monkeypatch
):
    """bf16 q, k, v (g and β fp32, as `KDA.inputs` gives them): autograd keeps them in bf16 (half the
    bytes), the output and state are fp32, and they equal the fp64 recurrence on the same bf16
    values to fp32 tolerance (the upcast is exact: only the rounding of the inputs differs from fp32
    inputs); the gradients come back in bf16 and equal the fp64 recurrence's rounded to bf16."""
    from policy import kda as kda_module

    monkeypatch.setattr(kda_module, "_SEGMENT_ELEMENTS", 16 * 2 * 3 * 8)  # several segments
    q, k, v, g, beta, S0 = _kda_inputs(torch.float32, T=45)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    rest = [t.requires_grad_() for t in (g, beta, S0)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t
    ):
        o, S = kda_chunked(*low, *rest[:2], rest[2], chunk_size=chunk, step_bound=5.0)
    assert o.dtype == S.dtype == torch.float32
    # kept as given
    assert sorted(n for dt, n in saved if dt == torch.bfloat16) == sorted(t.numel() for t in low)
    (o.pow(2).sum() + S.sum()).backward()
    ref = [t.detach().double().requires_grad_() for t in (*low, *rest)]
    o_ref, S_ref = kda_recurrent(*ref)
    (o_ref.pow(2).sum() + S_ref.sum()).backward()
    assert (o.double() - o_ref).abs().max() < 1e-4 and (S.double() - S_ref).abs().max() < 1e-4
    for t, r in zip((*low, *rest), ref):
        assert t.grad.dtype == t.dtype
        scale = r.grad.abs().max()
        # bf16: its rounding of the gradient
        tol = 1e-2 * scale if t.dtype == torch.bfloat16 else 1e-4 * scale
        assert (t.grad.double() - r.grad).abs().max() <= tol


def test_a_bf16_kda_layer_keeps_only_the_decay_and_beta_in_fp32_for_backward():
    """A bf16 KDA layer in training: of what autograd keeps per token, only the decay g and β are fp32
    (x, q, k, v and the recurrence's output are bf16), and its gradients are finite."""
    from policy.args import load_model_args

    args = load_model_args("configs/policy/debug.yaml")
    torch.manual_seed(0)
    layer = KDA(args.dim, args.kda).to(torch.bfloat16)
    T, H, K = 64, args.kda.n_heads, args.kda.head_dim
    x = torch.randn(1, T, args.dim, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t
    ):
        y = layer(x)
    per_token = [(dt, shape) for dt, shape in saved if T in shape]
    assert sorted(shape for dt, shape in per_token if dt == torch.float32) == [
        (1, T, H),
        (1, T, H, K),
    ]
    # x (twice: both recomputes), q, k, v, o
    assert sum(dt == torch.bfloat16 for dt, _ in per_token) >= 5
    y.float().pow(2).sum().backward()
    assert torch.isfinite(x.grad).all() and all(
        torch.isfinite(p.grad).all() for p in layer.parameters()
    )


def test_the_chunk_form_saves_only_its_inputs_and_a_state_per_segment(monkeypatch):
    """Autograd keeps, for the chunk form, its five inputs and the state at each segment's start:
    nothing per token beyond the inputs; the intermediates and the chunks' states are recomputed in
    backward."""
    from policy import kda as kda_module

    monkeypatch.setattr(kda_module, "_SEGMENT_ELEMENTS", 64 * 2 * 16)  # 64 tokens
    q, k, v, g, beta, _ = (
        t.requires_grad_(True) for t in _kda_inputs(torch.float32, B=1, T=256, H=2, K=16, V=16)
    )
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t
    ):
        o, S = kda_chunked(q, k, v, g, beta, chunk_size=16, step_bound=5.0)
    inputs_bytes = sum(t.numel() * 4 for t in (q, k, v, g, beta))
    states_bytes = (256 // 64) * 2 * 16 * 16 * 4
    assert sum(saved) == inputs_bytes + states_bytes, (sum(saved), inputs_bytes, states_bytes)
    (o.sum() + S.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, g, beta))


def test_kda_chunked_is_stable_under_strong_decay():
    q, k, v, g, beta, S0 = _kda_inputs(torch.float32, T=128)
    # e^{-G} would be e^{320}
    o, S = kda_chunked(q, k, v, torch.full_like(g, -5.0), beta, S0, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()


@pytest.mark.parametrize("gate", ["safe", "softplus"])
def test_kda_layer_decoding_matches_training_form(gate):
    torch.manual_seed(0)
    layer = KDA(
        32,
        KDAArgs(
            n_heads=2, head_dim=8, gate=gate, chunk_size=4, gate_rank=4 if gate == "softplus" else 0
        ),
    ).double()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    full = layer(x)
    st = KDAState()
    parts = [layer(x[:, :5], st)] + [layer(x[:, t : t + 1], st) for t in range(5, 11)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-10)
    assert st.S.dtype == torch.float64 and st.conv_q.shape == (2, 16, 3)
    g = layer.decay(x)
    if gate == "safe":
        assert (g >= -5.0).all() and (g <= 0).all()
    else:
        assert (g <= 0).all()


@pytest.mark.parametrize("rope", [False, True])
def test_mla_absorbed_equals_naive(rope):
    torch.manual_seed(0)
    layer = GatedMLA(32, MLAArgs(rope=rope)).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    naive = layer(x, absorbed=False, fused=False)
    assert torch.allclose(layer(x, absorbed=False), naive, atol=1e-12)  # fused SDPA path
    assert torch.allclose(layer(x, absorbed=True), naive, atol=1e-12)
    cache = MLACache()
    steps = [layer(x[:, :4], cache, absorbed=False)] + [
        layer(x[:, t : t + 1], cache, absorbed=True) for t in range(4, 9)
    ]
    assert torch.allclose(torch.cat(steps, 1), naive, atol=1e-12)
    a = layer.a
    assert cache.c_kv.shape == (2, 9, a.kv_lora_rank) and cache.k_rope.shape == (
        2,
        9,
        a.qk_rope_head_dim,
    )


def test_mla_output_gate_scales_each_channel():
    torch.manual_seed(0)
    layer = GatedMLA(32, MLAArgs()).double()
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        layer.w_gate.weight.zero_()  # sigmoid(0) = 1/2 on every channel
        half = layer(x)
        open_gate = torch.nn.Linear(32, layer.w_gate.out_features).double()
        open_gate.weight.zero_()
        open_gate.bias.fill_(60.0)
        layer.w_gate = open_gate
        full = layer(x)  # sigmoid(60) = 1: ungated
    assert torch.allclose(half, full / 2, atol=1e-12) and full.abs().max() > 0


def test_situ_glu_bounded_matches_swiglu_near_zero_and_keeps_gradients():
    b1, b2 = 4.0, 25.0
    big = torch.tensor([-1e4, -300.0, 300.0, 1e4])
    g, u = torch.meshgrid(big, big, indexing="ij")
    assert (situ_glu(g, u, b1, b2).abs() <= b1 * b2).all()
    assert situ_glu(torch.tensor(1e4), torch.tensor(1e4), b1, b2).item() == pytest.approx(b1 * b2)
    small = torch.linspace(-0.05, 0.05, 11, dtype=torch.float64)
    gs, us = torch.meshgrid(small, small, indexing="ij")
    rel = (situ_glu(gs, us, b1, b2) - swiglu(gs, us)).abs().max() / swiglu(gs, us).abs().max()
    assert rel < 5e-3
    # large b recovers SwiGLU
    x = torch.randn(100, dtype=torch.float64) * 3
    assert torch.allclose(situ_glu(x, x.flip(0), 1e6, 1e6), swiglu(x, x.flip(0)), rtol=1e-6)
    # gradients stay non-zero where SwiGLU's up path is unbounded and far from zero
    gx = torch.tensor([-20.0, -8.0, 8.0, 30.0], requires_grad=True)
    ux = torch.tensor([-150.0, -60.0, 60.0, 150.0], requires_grad=True)
    situ_glu(gx, ux, b1, b2).sum().backward()
    assert (gx.grad != 0).all() and (ux.grad != 0).all()


def test_situ_glu_s_backward_equals_autograd_of_its_formula_and_saves_only_its_inputs():
    """The hand-written backward equals autograd through the formula (fp64, including saturated
    inputs); from bf16 inputs it saves g and u alone, in bf16."""
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(64, 40, generator=gen, dtype=torch.float64) * 30).requires_grad_()
    u = (torch.randn(64, 40, generator=gen, dtype=torch.float64) * 80).requires_grad_()
    dy = torch.randn(64, 40, generator=gen, dtype=torch.float64)
    ref = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
    want = torch.autograd.grad(ref, (g, u), dy)
    out = situ_glu(g, u, 4.0, 25.0)
    got = torch.autograd.grad(out, (g, u), dy)
    assert torch.allclose(out, ref, atol=1e-12) and all(
        torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want)
    )
    gb, ub = (t.detach().bfloat16().requires_grad_() for t in (g, u))
    _, saved = _saved_bytes(lambda: situ_glu(gb, ub, 4.0, 25.0))
    assert saved == 2 * 64 * 40 * 2


def test_rms_norm_s_backward_equals_autograd_of_its_formula_and_saves_x_and_one_number_a_row():
    from policy.norm import rms_norm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 40, generator=gen, dtype=torch.float64) * 5).requires_grad_()
    w = torch.randn(40, generator=gen, dtype=torch.float64).requires_grad_()
    dy = torch.randn(3, 7, 40, generator=gen, dtype=torch.float64)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    want = torch.autograd.grad(ref, (x, w), dy)
    out = rms_norm(x, w, 1e-5)
    got = torch.autograd.grad(out, (x, w), dy)
    assert torch.allclose(out, ref, atol=1e-12) and all(
        torch.allclose(a, b, atol=1e-10) for a, b in zip(got, want)
    )
    xb = x.detach().bfloat16().requires_grad_()
    out, saved = _saved_bytes(lambda: rms_norm(xb, w, 1e-5))
    assert out.dtype == torch.bfloat16 and saved == 3 * 7 * 40 * 2 + 40 * 8 + 3 * 7 * 4


def _moe(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    a = MoEArgs(
        **{
            "n_routed_experts": 8,
            "top_k": 2,
            "n_shared_experts": 1,
            "expert_dim": 16,
            "latent_dim": 12,
            **kw,
        }
    )
    return LatentMoE(24, a, Activation("situ", 4.0, 25.0)).to(dtype)


def test_moe_expert_loop_equals_dense_reference():
    moe = _moe()
    x = torch.randn(3, 7, 24, dtype=torch.float64)
    y, info = moe(x)
    idx, w, _, _ = moe.router(x.reshape(-1, 24))
    assert torch.allclose(y, naive_moe(moe, x, idx, w), atol=1e-12)
    assert info["load"].sum().item() == 3 * 7 * 2
    assert torch.allclose(w.sum(-1), torch.ones(21, dtype=w.dtype))


@pytest.mark.parametrize("batched", [True, False])
def test_both_dispatch_paths_equal_the_dense_reference_with_gradients(batched):
    """The padded batched matmuls and the loop over sorted slices give the dense reference's
    output and the same gradients for every weight, in fp64; with routing skewed onto one expert
    the automatic choice takes the loop (padding would cost E× the rows)."""
    moe = _moe()
    lat = torch.randn(40, 12, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 8, (40, 2))
    idx[:, 1] = (idx[:, 0] + 1 + torch.randint(0, 7, (40,))) % 8  # two different experts per token
    # expert 7 may get nothing; the paths must cope with empty experts
    idx[:3] = torch.tensor([5, 6])
    w = torch.rand(40, 2, dtype=torch.float64)
    dense_NE = torch.zeros(40, 8, dtype=torch.float64).scatter_add(1, idx, w)
    ref = torch.einsum("ne,enl->nl", dense_NE, torch.stack([moe.expert(e, lat) for e in range(8)]))
    params = [lat, moe.w_gate_EFL, moe.w_up_EFL, moe.w_down_ELF]
    want = torch.autograd.grad((ref * ref.detach().sin()).sum(), params)
    got = moe.routed(lat, idx, w, batched=batched)
    assert torch.allclose(got, ref, atol=1e-12)
    for g, r in zip(torch.autograd.grad((got * ref.detach().sin()).sum(), params), want):
        assert torch.allclose(g, r, atol=1e-12)
    skewed = torch.zeros(40, 2, dtype=torch.long)
    skewed[:, 1] = torch.arange(40) % 7 + 1
    from policy import moe as moe_module

    calls = []
    original = moe_module.LatentMoE.expert
    moe_module.LatentMoE.expert = lambda self, e, x, weights=None: (
        calls.append(e) or original(self, e, x, weights)
    )
    try:
        moe.routed(lat, skewed, w)  # expert 0 takes every token: 8 × 40 padded rows > 2 × 80
    finally:
        moe_module.LatentMoE.expert = original
    assert sorted(calls) == list(range(8))  # the loop ran, once per expert with rows


def test_group_limited_routing_stays_in_the_chosen_groups():
    moe = _moe(n_groups=4, topk_groups=1, top_k=2)
    x = torch.randn(64, 24, dtype=torch.float64)
    idx, _, _, _ = moe.router(x)
    assert (idx // 2).unique(dim=1).shape[1] == 1  # both experts of a token in one group of two


def test_routing_replay_uses_recorded_experts_and_router_still_learns():
    moe = _moe()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    recorded = torch.randint(0, 8, (2, 5, 1)).repeat(1, 1, 2)
    recorded[..., 1] = (recorded[..., 0] + 3) % 8
    y, info = moe(x, recorded)
    assert torch.equal(info["experts"], recorded)
    free, _ = moe(x)
    assert not torch.allclose(y, free)  # the recorded choice is not what the router would pick
    y.sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def _skewed_router():
    torch.manual_seed(0)
    router = Router(32, MoEArgs(n_routed_experts=16, top_k=2))
    with torch.no_grad():
        router.weight[:4] += 0.3 * torch.randn(32)
    x = torch.randn(4096, 32) + 0.5
    return router, x


def _updates_to_balance(update, limit=400):
    router, x = _skewed_router()
    bias = torch.zeros(16)
    for step in range(limit):
        router.bias.copy_(bias)
        idx, _, scores, _ = router(x)
        load = torch.bincount(idx.flatten(), minlength=16)
        if step == 0:
            assert load_imbalance(load) > 2.0  # deliberately skewed
        if load_imbalance(load) <= 1.2:
            return step
        bias = update(scores, load, bias)
    return limit


def test_quantile_balancing_beats_sign_update():
    qb = _updates_to_balance(lambda s, load, b: quantile_bias(s, b, 2))
    sign = _updates_to_balance(lambda s, load, b: sign_update(load, b, 1e-3))
    assert qb <= 8
    assert qb < sign


def test_quantile_histogram_is_summable_and_close_to_exact():
    router, x = _skewed_router()
    idx, _, scores, _ = router(x)
    bias = torch.zeros(16)
    whole = QuantileHistogram(16, 2)
    whole.add(scores, bias)
    a, b = QuantileHistogram(16, 2), QuantileHistogram(16, 2)
    a.add(scores[:1000], bias)
    b.add(scores[1000:], bias)
    assert torch.equal(a.merge(b).counts_EB, whole.counts_EB)
    assert (whole.bias() - quantile_bias(scores, bias, 2)).abs().max() < 0.01  # bin width is 0.004
    hist_steps = _updates_to_balance(lambda s, load, bb: _hist_step(s, bb))
    assert hist_steps <= 8


def _hist_step(scores, bias):
    h = QuantileHistogram(16, 2)
    h.add(scores, bias)
    return h.bias()


def test_mla_fused_attention_gradients_equal_explicit():
    torch.manual_seed(0)
    layer = GatedMLA(32, MLAArgs(rope=True)).double()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        layer.zero_grad()
        layer(x, fused=fused).pow(2).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in layer.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-10)


def test_kda_chunked_gradients_equal_recurrent():
    inputs = [t.requires_grad_(True) for t in _kda_inputs(torch.float64, T=19)]
    grads = []
    for fn in (lambda *a: kda_recurrent(*a), lambda *a: kda_chunked(*a, chunk_size=8)):
        for t in inputs:
            t.grad = None
        o, S = fn(*inputs)
        (o.pow(2).sum() + S.sum()).backward()
        grads.append(torch.cat([t.grad.flatten() for t in inputs]))
    assert torch.allclose(grads[0], grads[1], atol=1e-9)


def test_the_safe_gate_starts_with_memory_and_its_rates_stay_fp32_without_weight_decay(tmp_path):
    """At initialisation the safe gate's per-step decay with f = 0 lies in [0.90, 0.99] for every
    channel (a zero dt_bias would give e^{-2.5} ≈ 0.08: memoryless); a checkpoint loaded in bf16
    keeps A_log, dt_bias and the routers' selection biases in fp32, and the learner trains the
    decay rates in an optimiser group of their own without weight decay."""
    import dataclasses

    from policy.args import load_model_args
    from policy.checkpoint import load_policy, save_policy
    from policy.kda import KDA
    from policy.model import Policy
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner

    args = load_model_args("configs/policy/debug.yaml")
    torch.manual_seed(0)
    kda = KDA(args.dim, dataclasses.replace(args.kda, gate="safe"))
    decay = kda.decay(torch.zeros(1, 1, args.dim)).exp()  # f = 0
    assert 0.90 - 1e-6 <= decay.min() and decay.max() <= 0.99 + 1e-6
    x = torch.randn(2, 64, args.dim)
    assert kda.decay(x).exp().median() > 0.85  # with the random decay projection at init, too
    path = save_policy(Policy(args), tmp_path / "ckpt")
    model = load_policy(path, dtype=torch.bfloat16)
    dtypes = {n.rsplit(".", 1)[-1]: p.dtype for n, p in model.named_parameters()}
    assert (
        dtypes["A_log"] == dtypes["dt_bias"] == torch.float32 and dtypes["weight"] == torch.bfloat16
    )
    assert all(
        b.dtype == torch.float32 for n, b in model.named_buffers() if n.endswith("router.bias")
    )
    learner = Learner(str(path), AlgoConfig(weight_decay=0.1), LearnerConfig(threads=1))
    rates = {id(p) for n, p in learner.model.named_parameters() if n.endswith(("A_log", "dt_bias"))}
    main, own = learner.opt.param_groups
    assert (
        own["weight_decay"] == 0.0
        and main["weight_decay"] == 0.1
        and {id(p) for p in own["params"]} == rates
    )
    assert not rates & {id(p) for p in main["params"]}


def test_a_chunk_size_that_cannot_be_cut_into_sub_chunks_is_refused(tmp_path):
    from policy.args import load_model_args
    from typed_yaml import ConfigError

    with pytest.raises(ValueError, match="chunk_size 24"):
        kda_chunked(*_kda_inputs(torch.float32), chunk_size=24)
    cfg = tmp_path / "p.yaml"
    cfg.write_text("kda: {chunk_size: 24}\n")
    with pytest.raises(ConfigError, match="kda.chunk_size must be <= 16 or a multiple of 16"):
        load_model_args(cfg)


def _saved_bytes(fn):
    """(result, bytes of the distinct storages autograd saved while running fn)."""
    seen = {}
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: (
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t
        ),
        lambda t: t,
    ):
        out = fn()
    return out, sum(seen.values())


def test_the_kda_layer_recomputes_its_projections_in_training_with_the_same_gradients():
    """Training (no decoding state) keeps x and the recurrence's inputs and recomputes the
    projections, convs, norms and output gate in backward: same output and parameter gradients as
    the path that keeps everything (taken when a state is passed), in fp64, and under half the saved
    bytes."""
    torch.manual_seed(0)
    layer = KDA(32, KDAArgs(n_heads=2, head_dim=16, chunk_size=16)).double()
    x = torch.randn(2, 40, 32, dtype=torch.float64, requires_grad=True)
    results = []
    for state in (None, KDAState()):
        layer.zero_grad()
        x.grad = None
        y, saved = _saved_bytes(lambda state=state: layer(x, state))
        y.pow(2).sum().backward()
        results.append(
            (
                y.detach(),
                torch.cat([p.grad.flatten() for p in layer.parameters()] + [x.grad.flatten()]),
                saved,
            )
        )
    (y0, g0, kept), (y1, g1, plain) = results
    assert torch.allclose(y0, y1, atol=1e-12) and torch.allclose(g0, g1, atol=1e-10)
    assert kept < plain / 2, (kept, plain)


def _attn_res_mix_naive(w_D, sources, eps):
    """AttnRes as written in the paper: stack, RMS-normalise, score, softmax over sources, mix."""
    V = torch.stack(sources).to(torch.promote_types(sources[-1].dtype, torch.float32))
    alpha = torch.softmax(
        torch.einsum(
            "sbtd,d->sbt", V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps), w_D.to(V.dtype)
        ),
        0,
    )
    return torch.einsum("sbt,sbtd->btd", alpha, V).to(sources[-1].dtype)


@pytest.mark.parametrize("n_sources", [1, 2, 4])
def test_the_attn_res_mix_equals_the_naive_one_and_keeps_only_its_sources(n_sources):
    """The hand-written backward of the AttnRes mix gives the naive mix's output and gradients (for
    the pseudo-query and every source) in fp64, within bf16 tolerance from bf16 sources; it saves
    the sources themselves plus two numbers per source and token, not stacked normalised copies."""
    from policy.model import attn_res_mix

    g = torch.Generator().manual_seed(n_sources)
    w = torch.randn(24, generator=g, dtype=torch.float64, requires_grad=True)
    sources = [
        (torch.randn(2, 9, 24, generator=g, dtype=torch.float64) * (i + 1)).requires_grad_()
        for i in range(n_sources)
    ]
    grads = []
    for mix in (_attn_res_mix_naive, attn_res_mix):
        for t in [w, *sources]:
            t.grad = None
        out, saved = _saved_bytes(lambda mix=mix: mix(w, sources, 1e-5))
        (out * torch.linspace(-1, 1, 24, dtype=torch.float64)).pow(2).sum().backward()
        grads.append((out.detach(), torch.cat([t.grad.flatten() for t in [w, *sources]]), saved))
    (o_ref, g_ref, _), (o, gr, saved) = grads
    assert torch.allclose(o, o_ref, atol=1e-12) and torch.allclose(gr, g_ref, atol=1e-10)
    assert saved == 24 * 8 + n_sources * 2 * 9 * 24 * 8 + 2 * n_sources * 2 * 9 * 8
    bf = [s.detach().bfloat16() for s in sources]
    assert (
        attn_res_mix(w.detach(), bf, 1e-5).double()
        - _attn_res_mix_naive(w.detach(), bf, 1e-5).double()
    ).abs().max() < 0.05

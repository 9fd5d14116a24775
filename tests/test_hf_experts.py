"""Hugging Face MoE experts under bf16 autocast (rl/learner/hf_experts.py): the sorted, padded per-expert
path against transformers' own per-expert loop, the bf16 operands it promises, and the cast cache."""

from __future__ import annotations

import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl.learner import hf_experts
from rl.learner.hf_experts import KEY, ROWS, cast, casts_cached, sorted_experts_forward


def _experts(dtype=torch.float64, experts: int = 4, seed: int = 0):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(
        hidden_size=24, intermediate_size=40, num_local_experts=experts, num_experts_per_tok=2
    )
    cfg._experts_implementation = "eager"  # the module's own forward: transformers' per-expert loop
    torch.manual_seed(seed)
    ex = MixtralExperts(cfg)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return ex.to(dtype)


def _routing(n: int, experts: int, k: int = 2, skip: int | None = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e != skip])  # one expert gets no token
    idx_Nk = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(n)])
    w_Nk = torch.rand(n, k, generator=g, dtype=torch.float64).softmax(-1)
    return idx_Nk, w_Nk


def test_sorted_experts_forward_equals_the_per_expert_loop_in_fp64():
    ex = _experts()
    idx_Nk, w_Nk = _routing(37, 4)
    x_ref = torch.randn(37, 24, dtype=torch.float64, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    ref = ex(x_ref, idx_Nk, w_Nk)
    grads_ref = torch.autograd.grad(ref.pow(2).sum(), [x_ref, ex.gate_up_proj, ex.down_proj])
    ex.has_gate, ex.is_concatenated = True, True
    out = sorted_experts_forward(ex, x, idx_Nk, w_Nk)
    grads = torch.autograd.grad(out.pow(2).sum(), [x, ex.gate_up_proj, ex.down_proj])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    assert float(grads[1][3].abs().sum()) == 0.0  # the expert no token chose gets a zero gradient


class _MatmulDtypes(TorchDispatchMode):
    """Records the operand dtypes, the first operand's rows and the second's storage of every
    matmul dispatched."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (
            torch.ops.aten.mm.default,
            torch.ops.aten._grouped_mm.default,
            torch.ops.aten.addmm.default,
        ):
            a, b = (
                (args[1], args[2]) if func is torch.ops.aten.addmm.default else (args[0], args[1])
            )
            self.seen.append((a.dtype, b.dtype, a.shape[0], b.untyped_storage().data_ptr()))
        return func(*args, **(kwargs or {}))


def test_under_bf16_autocast_the_experts_multiply_in_bf16_on_padded_blocks(tiny_policy):
    """The model's experts run bf16 matmuls on blocks of a multiple of ROWS rows (where transformers
    cast the activations up to the fp32 weights), close to the fp32 forward, with fp32 gradients."""
    from rl.learner.logprobs import load_causal_lm

    lm = load_causal_lm(tiny_policy, torch.float32)
    model = lm.module
    assert model.config._experts_implementation == KEY
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    ids = torch.randint(3, 400, (2, 45), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits
    with casts_cached(), torch.autocast("cpu", dtype=torch.bfloat16), _MatmulDtypes() as rec:
        out = model(ids).logits
        weights = {
            cast(getattr(m, n), torch.bfloat16).untyped_storage().data_ptr()
            for m in experts
            for n in ("gate_up_proj", "down_proj")
        }  # the casts the forward used
    expert_mms = [s for s in rec.seen if s[3] in weights]
    assert len(expert_mms) >= 2 * len(experts)
    assert all(a == b == torch.bfloat16 for a, b, *_ in expert_mms)
    assert all(rows % ROWS == 0 for _, _, rows, _ in expert_mms)
    torch.testing.assert_close(out.float().softmax(-1), ref.softmax(-1), atol=2e-2, rtol=0)
    out.float().logsumexp(-1).sum().backward()
    for m in experts:
        assert (
            m.gate_up_proj.grad.dtype == torch.float32
            and float(m.gate_up_proj.grad.abs().sum()) > 0
        )


def test_the_cast_is_shared_within_an_optimizer_step_and_never_across():
    """Inside `casts_cached()` (one optimizer step's micro-batches) a weight is cast once and the
    gradient reaches the fp32 weight; after it, an update made by fused AdamW, which leaves the
    version counter alone, is what the next cast sees."""
    w = torch.nn.Parameter(torch.randn(4, 8, 6))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    with casts_cached():
        a, b = cast(w, torch.bfloat16), cast(w, torch.bfloat16)
        assert a.data_ptr() == b.data_ptr()  # shared by micro-batches and recomputed forwards
        (a.float().sum() + b.float().sum()).backward()
    assert not hf_experts._CASTS  # dropped with the scope
    # the gradient reaches the fp32 weight
    torch.testing.assert_close(w.grad, torch.full_like(w, 2.0))
    version = w._version
    opt.step()
    assert w._version == version  # why a cache keyed by version alone would serve stale weights
    with casts_cached():
        c = cast(w, torch.bfloat16)
    torch.testing.assert_close(c.float(), w.detach().to(torch.bfloat16).float(), rtol=0, atol=0)
    # outside: no cache
    assert cast(w, torch.bfloat16).data_ptr() != cast(w, torch.bfloat16).data_ptr()


def test_a_bf16_learner_forwards_its_updated_experts(tiny_policy, monkeypatch):
    """Every cast a bf16 learner step multiplies with is of the weights as that step found them:
    the second step's, after the first step's (fused AdamW) update, not the first's."""
    from test_learner_device import _batch

    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner

    learner = Learner(
        tiny_policy,
        AlgoConfig(minibatch_episodes=4, lr=0.05),
        LearnerConfig(threads=1, precision="bf16"),
    )
    batch = _batch()
    learner.train_step(batch)
    assert not hf_experts._CASTS
    experts = [m for m in learner.model.modules() if hasattr(m, "gate_up_proj")]
    now = {id(m.gate_up_proj): m.gate_up_proj.detach().to(torch.bfloat16) for m in experts}
    seen, real_cast = [], hf_experts._low

    def spy(weight, dtype):  # every cast of an expert weight goes through `_low`
        out = real_cast(weight, dtype)
        if id(weight) in now:
            seen.append(torch.equal(out.detach(), now[id(weight)]))
        return out

    monkeypatch.setattr(hf_experts, "_low", spy)
    learner.train_step(batch)
    assert seen and all(seen)
    assert any(
        not torch.equal(m.gate_up_proj.detach().to(torch.bfloat16), now[id(m.gate_up_proj)])
        for m in experts
    )


def test_the_choice_is_not_saved_with_the_checkpoint(tiny_policy, tmp_path):
    from rl.learner.logprobs import load_causal_lm

    lm = load_causal_lm(tiny_policy, torch.float32)
    lm.module.save_pretrained(tmp_path)
    assert KEY not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_outside_autocast_the_forward_is_transformers_own(tiny_policy):
    """fp32 training, evaluation and scoring are unchanged: the same logits bit for bit."""
    from transformers import AutoModelForCausalLM

    from rl.learner.logprobs import load_causal_lm

    ours = load_causal_lm(tiny_policy, torch.float32).module
    theirs = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32)
    assert theirs.config._experts_implementation == "grouped_mm"
    ids = torch.randint(3, 400, (1, 30), generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(ids).logits, theirs(ids).logits)


def _two_micro_batches(ex, monkeypatch, direct: bool):
    """The experts' weight gradients after two bf16-autocast micro-batches of one optimizer step
    (one of them leaves an expert without tokens), by `_ExpertViews` or by the cast's own backward."""
    if not direct:
        monkeypatch.setattr(hf_experts, "_writes_own_grad", lambda w: False)
    ex.gate_up_proj.grad = ex.down_proj.grad = None
    xs = []
    with casts_cached():
        for n, skip, seed in ((37, 3, 1), (29, None, 2)):
            idx_Nk, w_Nk = _routing(n, 4, skip=skip, seed=seed)
            x = torch.randn(n, 24, generator=torch.Generator().manual_seed(seed)).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = sorted_experts_forward(ex, x, idx_Nk, w_Nk.float())
            out.float().pow(2).sum().backward()
            xs.append(x.grad)
    monkeypatch.undo()
    return ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone(), xs


def test_expert_views_add_the_gradient_the_cast_would_bit_for_bit(monkeypatch):
    """The direct per-expert accumulation into the fp32 gradient (`_ExpertViews`) against the cast's
    backward (stack, convert, AccumulateGrad): the same bits, over micro-batches, with an expert
    that one micro-batch leaves unused."""
    ex = _experts(torch.float32)
    ex.has_gate, ex.is_concatenated = True, True
    assert hf_experts._writes_own_grad(ex.gate_up_proj)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (
            type(hf_experts.expert_views(ex.gate_up_proj, torch.bfloat16)[0].grad_fn).__name__
            == "_ExpertViewsBackward"
        )
    direct = _two_micro_batches(ex, monkeypatch, direct=True)
    ref = _two_micro_batches(ex, monkeypatch, direct=False)
    for a, b in zip(direct[:2], ref[:2]):
        assert a.dtype == torch.float32 and float(a.abs().sum()) > 0
        assert torch.equal(a, b)
    for a, b in zip(direct[2], ref[2]):
        assert torch.equal(a, b)


def test_a_weight_with_a_gradient_hook_keeps_the_casts_backward():
    """A hook on the weight (as a parallel wrapper would register) must see its gradient pass, so
    such a weight is not written directly."""
    ex = _experts(torch.float32)
    ex.has_gate, ex.is_concatenated = True, True
    seen = []
    ex.gate_up_proj.register_hook(lambda g: seen.append(g.dtype))
    assert not hf_experts._writes_own_grad(ex.gate_up_proj) and hf_experts._writes_own_grad(
        ex.down_proj
    )
    idx_Nk, w_Nk = _routing(37, 4)
    with casts_cached(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = sorted_experts_forward(ex, torch.randn(37, 24), idx_Nk, w_Nk.float())
    out.float().sum().backward()
    assert seen == [torch.float32]
    assert float(ex.gate_up_proj.grad.abs().sum()) > 0 and float(ex.down_proj.grad.abs().sum()) > 0


def test_inside_a_group_of_several_ranks_the_experts_keep_the_casts_backward(monkeypatch):
    """A learner group's process (FSDP collects its weights' gradients) keeps autograd's own
    accumulation; a group of one (vLLM starts one in any process running an engine in-process, as
    this test session does) shards nothing and keeps the direct path. The group's size is what is
    decided on, so it is set here rather than formed (a process can join one default group only)."""
    import torch.distributed as dist

    w = torch.nn.Parameter(torch.randn(4, 8, 6))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 1)
    assert hf_experts._writes_own_grad(w)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    assert not hf_experts._writes_own_grad(w)
    with casts_cached(), torch.autocast("cpu", dtype=torch.bfloat16):
        views = hf_experts.expert_views(w, torch.bfloat16)
    assert type(views[0].grad_fn).__name__ == "UnbindBackward0"
    sum(v.float().sum() for v in views).backward()
    torch.testing.assert_close(w.grad, torch.ones_like(w))

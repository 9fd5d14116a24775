"""The whole policy: cached decoding vs the full forward, routing replay through the stack,
vision placeholders, checkpoints, and the full-scale config's size on the meta device."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from policy.args import load_model_args
from policy.checkpoint import load_policy, save_policy
from policy.info import policy_info
from policy.model import Policy
from rl.config import ConfigError

DEBUG = REPO / "configs" / "policy" / "debug.yaml"


@pytest.fixture(scope="module")
def args():
    return load_model_args(DEBUG)


def _model(args, dtype=torch.float64, **changes):
    torch.manual_seed(0)
    return Policy(dataclasses.replace(args, **changes)).to(dtype)


@pytest.mark.parametrize("attn_res", [True, False])
def test_cached_decoding_equals_full_forward_at_every_position(args, attn_res):
    model = _model(args, attn_res=attn_res)
    assert args.layer_kinds() == ["kda", "kda", "kda", "mla"]
    ids = torch.randint(2, args.vocab_size, (2, 29))
    full, _, info = model(ids)
    cache = model.new_cache()
    steps = [model(ids[:, :10], cache=cache)[0]] + [
        model(ids[:, t : t + 1], cache=cache)[0] for t in range(10, 29)
    ]
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-10
    assert cache.seq_len == 29
    assert info["experts"].shape == (3, 2, 29, 2) and info["load"].shape == (3, 8)


def test_attn_res_starts_as_uniform_average_and_its_queries_learn(args):
    model = _model(args, dtype=torch.float32)
    ids = torch.randint(2, args.vocab_size, (1, 12))
    logits, _, _ = model(ids)
    logits.logsumexp(-1).mean().backward()
    queries = (
        [blk.res_q_attn for blk in model.layers[1:]]
        + [blk.res_q_mlp for blk in model.layers]
        + [model.res_q_out]
    )
    # layer 0's attention reads only the embedding
    assert not hasattr(model.layers[0], "res_q_attn")
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in queries)
    assert all(q.abs().sum() == 0 for q in queries)  # zero init: a uniform average to start


def test_routing_replay_through_the_stack(args):
    model = _model(args)
    ids = torch.randint(2, args.vocab_size, (1, 16))
    _, _, free = model(ids)
    recorded = (free["experts"] + 1) % args.moe.n_routed_experts
    logits, _, replayed = model(ids, routing=recorded)
    assert torch.equal(replayed["experts"], recorded)
    logits.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in model.routers())


def test_images_enter_at_placeholders(args):
    model = _model(args)
    v = args.vision
    img = torch.rand(2, 3, 16, 24, dtype=torch.float64)
    n = model.vision.patches_per_image(16, 24)
    ids = torch.randint(2, args.vocab_size, (1, 2 * n + 5))
    ids[0, 3 : 3 + 2 * n] = v.image_token_id
    with_img, _, _ = model(ids, images=img)
    other, _, _ = model(ids, images=torch.rand(2, 3, 16, 24, dtype=torch.float64))
    assert not torch.allclose(with_img[0, 3:], other[0, 3:])  # positions after the image see it
    # causal: tokens before it do not
    assert torch.allclose(with_img[0, :3], other[0, :3], atol=1e-12)
    with pytest.raises(ValueError, match="image placeholder tokens for 1 image"):
        model(ids, images=img[:1])
    with pytest.raises(ValueError, match="no images were given"):
        model(ids)


def test_save_load_round_trip_is_exact(args, tmp_path):
    model = _model(args, dtype=torch.float32)
    with torch.no_grad():
        for r in model.routers():
            r.bias.normal_()  # balancing state must survive too
    ids = torch.randint(2, args.vocab_size, (2, 13))
    save_policy(model, tmp_path / "ckpt")
    back = load_policy(tmp_path / "ckpt")
    assert back.args == model.args
    assert torch.equal(model(ids)[0], back(ids)[0])
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["model_type"] == "longhorizon_policy"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**cfg, "n_layers": 2}))
    with pytest.raises(ValueError, match="does not match the config"):
        load_policy(tmp_path / "ckpt")


def test_full_config_on_meta_matches_the_reference_counts():
    info = policy_info(load_model_args(REPO / "configs" / "policy" / "k3.yaml"))
    assert abs(info["total_params"] / 2.78e12 - 1) < 0.01
    assert abs(info["active_params"] / 104e9 - 1) < 0.01
    assert (info["kda_layers"], info["mla_layers"], info["moe_layers"]) == (69, 24, 92)
    assert info["layer_pattern"][3::4] == "M" * 23 and info["layer_pattern"][-1] == "M"
    assert info["cache_bytes_per_token"] == 24 * 576 * 2
    assert info["params_per_routed_expert"] == 3 * 3584 * 3072


def test_policy_info_cli_json():
    out = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "policy", "info", str(DEBUG), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=True,
    )
    info = json.loads(out.stdout)
    model = Policy(load_model_args(DEBUG))
    assert info["total_params"] == sum(p.numel() for p in model.parameters())
    assert 0 < info["active_params"] < info["total_params"]


def test_bad_policy_config_names_the_key(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("moe: {n_routed_experts: 8, top_k: 9}\n")
    with pytest.raises(ConfigError, match="p.yaml: moe.top_k must be in"):
        load_model_args(bad)
    bad.write_text("kda: {heads: 2}\n")
    with pytest.raises(ConfigError, match="unknown key 'kda.heads'"):
        load_model_args(bad)


@pytest.mark.parametrize("attn_res", [True, False])
def test_activation_checkpointing_gives_the_same_gradients(args, attn_res):
    model = _model(args, attn_res=attn_res)
    ids = torch.randint(2, args.vocab_size, (2, 21))
    grads, infos = [], []
    for ac in (False, True):
        model.activation_checkpointing = ac
        model.zero_grad()
        logits, _, info = model(ids)
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, args.vocab_size), ids[:, 1:].reshape(-1)
        ).backward()
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
        infos.append(info["experts"])
    assert torch.allclose(grads[0], grads[1], atol=1e-12)
    assert torch.equal(infos[0], infos[1])

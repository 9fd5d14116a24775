"""`longhorizon inspect DIR --html OUT.html`: one self-contained page (no network, no server).

The page holds the run's curves (mean reward, and held-out success with its 95% interval when the
run evaluated; both with axes), where each iteration's wall time went (rollout wait, learner,
weight sync, the rest; stacked bars), the episode list with filters (text, failure kind, environment,
policy version), and for the selected episode (its header: reward, each rubric part when the run
scores with one, how it ended):
- its group: every episode of the same GRPO group with its reward, advantage, failure kind, the
  tools it called turn by turn and the turn where it departs from the group's best; and the
  episode next to the best one, turn by turn, from that turn on highlighted;
- a labelled timeline along the token axis: turns (red when a turn failed: no tool call, a
  malformed or unknown call, a tool error, a sandbox limit), milestones, sandbox limits;
- its turns (generated text, tool results; error observations styled as errors, sandbox events);
- a per-token heat map of the generated tokens coloured by the engine's log-prob, the
  learner/engine ratio or the advantage (from the learner records), context grey.
Data is embedded as JSON and rendered by a small script.

Everything a run wrote is data, never markup: the embedded JSON has every `<`, `>` and `&` escaped
(so no text in it can end or comment out its script block), the record's numeric fields are made
numbers here (a crafted shard's turn or milestone fields cannot carry markup into the page), and the
script sets every string through `esc` (episode text, tool output, task, shard and file names,
failure messages).

Limits: at most `max_episodes` episodes (the newest, each read alone from the store) and
`max_tokens` tokens per episode are embedded, so a page stays small for long runs; the page says
when it cut something, and a group shows only its embedded episodes. Tokens are drawn a page of
2,000 at a time.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from pathlib import Path

from longhorizon.inspect import (
    compare_group,
    load_metrics,
    mean_advantage,
    opener_note,
    run_tokenizer,
    summary,
)
from rl.store import TrajectoryStore
from rollout.trajectory import FAILURE_KINDS


def _num(x, kind=int):
    """A stored value that should be a number, as one (0 when it is not: a crafted record)."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return kind(x) if ok else kind(0)


def _turn(turn) -> dict:
    """A turn as the page reads it: numbers as numbers, text as text, whatever the record held."""
    d = vars(turn)
    out = {
        k: _num(d.get(k))
        for k in (
            "gen_start",
            "gen_end",
            "obs_end",
            "tool_calls",
            "tool_errors",
            "policy_version",
            "seed",
        )
    }
    out.update({k: str(d.get(k) or "") for k in ("text", "observation", "finish_reason", "kind")})
    out.update({k: [str(x) for x in (d.get(k) or [])] for k in ("sandbox_events", "failures")})
    return out


def _milestone(m) -> dict:
    m = m if isinstance(m, dict) else {}
    return {
        "name": str(m.get("name", "")),
        "reward": _num(m.get("reward"), float),
        "turn": _num(m.get("turn")),
        "token": _num(m.get("token")),
    }


def embed(data) -> str:
    """`data` as JSON that cannot end, or comment out, the script block it is put in."""
    return json.dumps(data).replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def episode_payload(t, tok, max_tokens: int, learner: dict | None = None) -> dict:
    n = min(len(t.token_ids), max_tokens)
    pieces = (
        tok.convert_ids_to_tokens(t.token_ids[:n])
        if tok is not None
        else [str(i) for i in t.token_ids[:n]]
    )
    pieces = [
        p.replace("Ġ", " ").replace("Ċ", "\n") if isinstance(p, str) else str(p) for p in pieces
    ]
    return {
        "id": t.episode_id,
        "iteration": t.iteration,
        "group": t.group_id,
        "env": t.env_id,
        "seed": t.seed,
        "reward": t.reward,
        "reward_parts": t.reward_parts,
        "stop": t.stop_reason,
        "infra_error": t.infra_error,
        "task": t.task,
        "failure": t.failure,
        "versions": sorted({turn.policy_version for turn in t.turns}),
        "n_tokens": len(t.token_ids),
        "n_generated": t.num_generated,
        "cut": n < len(t.token_ids),
        "tokens": pieces,
        "mask": t.loss_mask[:n],
        "logprobs": [round(x, 4) for x in t.rollout_logprobs[:n]],
        "turns": [_turn(turn) for turn in t.turns],
        # a split episode (context segments, rollout/context.py; an agent program's rewritten history):
        # where its samples start, the turns that open them, and what each one is
        "samples": t.sample_starts,
        "sample_turns": t.sample_openers(),
        "context": t.context,
        "sample_notes": {i: opener_note(t, i, k) for i, k in t.sample_openers().items()},
        "milestones": [_milestone(m) for m in t.milestones],
        # the learner's pre-update log-probs and the advantages it trained with, when it trained on it
        "learner": [round(x, 4) for x in learner["learner_logprobs"][:n]] if learner else None,
        "adv": [round(x, 4) for x in learner["advantages"][:n]] if learner else None,
    }


def time_split(rows: list[dict]) -> list[dict]:
    """Per iteration, where its wall time went: waiting for rollouts (async: only what was not done
    yet), the learner's update, the weight sync, and the rest (store, evaluation, checkpoints)."""
    out = []
    for r in rows:
        if "iteration_s" not in r:
            continue
        parts = {k: float(r.get(k) or 0.0) for k in ("rollout_s", "train_s", "sync_s")}
        out.append(
            {
                "iteration": r["iteration"],
                **parts,
                "other_s": max(0.0, r["iteration_s"] - sum(parts.values())),
            }
        )
    return out


def write_html(
    run_dir: str | Path, out: str | Path, max_episodes: int = 500, max_tokens: int = 100_000
) -> Path:
    run_dir = Path(run_dir)
    s = summary(run_dir)
    tok = run_tokenizer(run_dir)
    store = TrajectoryStore(run_dir)
    # the newest `max_episodes`, read a few columns first so only those episodes are ever loaded whole
    ids = [r["episode_id"] for r in store.rows(["episode_id"], strict=False)]
    shown = set(ids[-max_episodes:])
    learner = {r["episode_id"]: r for r in store.learner_records() if r["episode_id"] in shown}
    trajs = list(store.episodes(ids[-max_episodes:]))
    payloads = [episode_payload(t, tok, max_tokens, learner.get(t.episode_id)) for t in trajs]
    by_group = defaultdict(list)
    for t in trajs:
        by_group[t.group_id].append(t)
    groups = {}
    for gid, eps in by_group.items():
        best, rows = compare_group(
            eps, {t.episode_id: mean_advantage(t, learner.get(t.episode_id)) for t in eps}
        )
        groups[gid] = {"best": best, "episodes": rows}

    def point(iteration: int, r: dict) -> dict:
        return {
            "iteration": iteration,
            "success": r["eval/success"],
            "lo": r.get("eval/ci95_low"),
            "hi": r.get("eval/ci95_high"),
        }

    held_out = [point(r["iteration"], r) for r in load_metrics(run_dir) if "eval/success" in r]
    # before the first iteration (after any warm start): drawn at -1
    initial = run_dir / "eval-initial.json"
    try:
        first = json.loads(initial.read_text()) if initial.exists() else {}
    except json.JSONDecodeError:
        first = {}
    if "eval/success" in first:
        held_out.insert(0, point(-1, first))
    data = {
        "summary": s,
        "episodes": payloads,
        "episodes_cut": len(ids) > max_episodes,
        "groups": groups,
        "held_out": held_out,
        "failure_kinds": FAILURE_KINDS,
        "time_split": time_split(load_metrics(run_dir)),
    }
    page = _TEMPLATE.replace("__TITLE__", html.escape(str(run_dir))).replace(
        "__DATA__", embed(data)
    )
    out = Path(out)
    out.write_text(page, encoding="utf-8")
    return out


_TEMPLATE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>longhorizon · __TITLE__</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;color:#222;display:grid;grid-template-columns:460px 1fr;height:100vh}
#left{border-right:1px solid #ddd;overflow:auto;padding:12px} #right{overflow:auto;padding:12px 20px}
h1{font-size:16px;margin:0 0 8px} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;width:100%} td,th{padding:3px 6px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
tr.episode-row,tr.group-row{cursor:pointer} tr.episode-row:hover,tr.group-row:hover{background:#f3f6ff} tr.sel{background:#e3ebff}
input,select{padding:4px;margin:3px 0;box-sizing:border-box} #filter{width:100%}
.filters{display:grid;grid-template-columns:1fr 1fr 1fr;gap:4px}
.turn{border:1px solid #cfe0ff;border-radius:6px;margin:8px 0;padding:6px 10px}
.obs{border-color:#ddd;background:#fafafa} .obs.err{border-color:#e3a0a0;background:#fff1f1}
.turn.summary{border-color:#e8c060;background:#fff8e4} b.summary{color:#a60}
.obs.err pre{color:#900} .fail{color:#b00} .ok{color:#080}
pre{white-space:pre-wrap;margin:4px 0;font:12px ui-monospace,monospace}
.tok{font:12px ui-monospace,monospace;white-space:pre-wrap;border-radius:2px}
.ctx{color:#888} .note{color:#a60} .axis{font-size:10px;fill:#555}
.pair{display:grid;grid-template-columns:1fr 1fr;gap:12px} .pair .head{font-weight:bold}
.departs{outline:2px solid #e0a000}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
</style></head><body>
<div id="left"><h1>__TITLE__</h1><div id="runsum"></div>
<svg id="curve" width="430" height="150"></svg><svg id="heldout" width="430" height="150"></svg>
<svg id="timesplit" width="430" height="170"></svg>
<input id="filter" placeholder="filter: id, env, stop reason, reward>0.5 ...">
<div class="filters"><select id="f-failure"><option value="">any failure kind</option></select>
<select id="f-env"><option value="">any environment</option></select>
<select id="f-version"><option value="">any policy version</option></select></div>
<table id="eplist"><thead><tr><th>episode</th><th>iter</th><th>reward</th><th>turns</th><th>failure</th></tr></thead><tbody></tbody></table></div>
<div id="right"><div>colour tokens by <select id="colour-by"><option value="lp">engine log-prob (green: likely)</option>
<option value="ratio">learner / engine ratio (green &gt; 1, red &lt; 1)</option><option value="adv">advantage (green &gt; 0, red &lt; 0)</option></select></div>
<div id="episode">select an episode</div></div>
<script id="data" type="application/json">__DATA__</script>
<script>
const D = JSON.parse(document.getElementById('data').textContent);
const esc = s => String(s).replace(/[&<>"']/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;',"'":'&#39;'}[c]));
const S = D.summary;
const TURN_FAILS = ['no_tool_call', 'malformed_call', 'unknown_tool', 'tool_error', 'sandbox_limit'];
const kindClass = k => k == 'success' ? 'ok' : 'fail';
document.getElementById('runsum').innerHTML = `${S.iterations} iterations · ${S.episodes} episodes · policy versions ${S.policy_versions.map(esc).join(', ')}`
  + (D.episodes_cut ? `<div class="note">showing the newest ${D.episodes.length} episodes</div>` : '')
  + (Object.keys(S.corrupt_shards||{}).length ? `<div class="note">corrupt shards skipped: ${Object.keys(S.corrupt_shards).map(esc).join(', ')}</div>` : '');
// A line chart with its axes: x = iteration, y from lo to hi with three labelled ticks.
function chart(id, title, xs, series, lo, hi){
  const svg = document.getElementById(id), W = 430, H = 150, L = 42, R = 10, T = 18, B = 26;
  if (!xs.length) { svg.innerHTML = `<text x="${L}" y="${T}" font-size="11">${esc(title)}: nothing recorded</text>`; return; }
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => H - B - (y - lo) / (hi - lo) * (H - T - B);
  let g = `<text x="${L}" y="12" font-size="11">${esc(title)}</text>`
    + `<line x1="${L}" y1="${H-B}" x2="${W-R}" y2="${H-B}" stroke="#888"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H-B}" stroke="#888"/>`;
  [lo, (lo + hi) / 2, hi].forEach(v => g += `<line x1="${L-3}" y1="${Y(v)}" x2="${W-R}" y2="${Y(v)}" stroke="#eee"/>`
    + `<text class="axis" x="${L-5}" y="${Y(v)+3}" text-anchor="end">${v.toFixed(2)}</text>`);
  const step = Math.max(1, Math.ceil((x1 - x0) / 8));
  for (let x = x0; x <= x1; x += step) g += `<text class="axis" x="${X(x)}" y="${H-B+12}" text-anchor="middle">${x < 0 ? 'start' : x}</text>`;
  g += `<text class="axis" x="${(L + W - R) / 2}" y="${H-2}" text-anchor="middle">iteration</text>`;
  series.forEach(s => {
    if (s.band) g += `<polygon fill="${s.colour}" fill-opacity="0.15" points="${s.band.map(([x,y]) => X(x)+','+Y(y)).join(' ')}"/>`;
    else g += `<polyline fill="none" stroke="${s.colour}" stroke-width="2" points="${s.pts.map(([x,y]) => X(x)+','+Y(y)).join(' ')}"/>`
      + s.pts.map(([x,y]) => `<circle r="3" fill="${s.colour}" cx="${X(x)}" cy="${Y(y)}"><title>iteration ${x}: ${y.toFixed(3)}</title></circle>`).join('');
  });
  svg.innerHTML = g;
}
(function curves(){
  const r = S.mean_reward, it = S.iteration_ids;
  chart('curve', 'mean episode reward per iteration', it, [{colour: '#36c', pts: it.map((x,i) => [x, r[i]])}],
        Math.min(0, ...r), Math.max(1e-9, ...r));
  const h = D.held_out;
  const band = h.filter(p => p.lo !== null && p.hi !== null);
  chart('heldout', 'held-out success (95% interval; start: before RL)', h.map(p => p.iteration),
        (band.length ? [{colour: '#2a8', band: band.map(p => [p.iteration, p.hi]).concat(band.slice().reverse().map(p => [p.iteration, p.lo]))}] : [])
        .concat([{colour: '#2a8', pts: h.map(p => [p.iteration, p.success])}]), 0, 1);
})();
// Where each iteration's wall time went, stacked: rollout wait, learner, weight sync, the rest.
(function timeSplit(){
  const svg = document.getElementById('timesplit'), rows = D.time_split, W = 430, H = 150, L = 42, R = 10, T = 18, B = 26;
  const parts = [['rollout_s', 'rollout wait', '#36c'], ['train_s', 'learner', '#e80'], ['sync_s', 'sync', '#2a8'], ['other_s', 'other', '#aaa']];
  if (!rows.length) { svg.innerHTML = `<text x="${L}" y="${T}" font-size="11">time per iteration: nothing recorded</text>`; return; }
  const top = Math.max(1e-9, ...rows.map(r => parts.reduce((a, p) => a + r[p[0]], 0)));
  const bw = (W - L - R) / rows.length, Y = v => (H - B) - v / top * (H - T - B);
  let g = `<text x="${L}" y="12" font-size="11">seconds per iteration: where the time went</text>`
    + `<line x1="${L}" y1="${H-B}" x2="${W-R}" y2="${H-B}" stroke="#888"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H-B}" stroke="#888"/>`;
  [0, top / 2, top].forEach(v => g += `<text class="axis" x="${L-5}" y="${Y(v)+3}" text-anchor="end">${v.toFixed(1)}</text>`);
  rows.forEach((r, i) => { let acc = 0; const x = L + i * bw + bw * 0.1;
    parts.forEach(([k, name, c]) => { const h = r[k] / top * (H - T - B);
      g += `<rect class="time-part" x="${x}" y="${Y(acc + r[k])}" width="${bw * 0.8}" height="${h}" fill="${c}"><title>iteration ${r.iteration}: ${name} ${r[k].toFixed(2)} s</title></rect>`;
      acc += r[k]; });
    if (rows.length <= 20 || i % Math.ceil(rows.length / 10) == 0) g += `<text class="axis" x="${x + bw * 0.4}" y="${H-B+12}" text-anchor="middle">${r.iteration}</text>`; });
  g += parts.map(([k, name, c], j) => `<rect x="${L + j * 95}" y="${H}" width="9" height="9" fill="${c}"/><text class="axis" x="${L + 12 + j * 95}" y="${H + 8}">${name}</text>`).join('');
  svg.innerHTML = g;
})();
function fill(id, values){ const el = document.getElementById(id);
  values.forEach(v => { const o = document.createElement('option'); o.value = o.textContent = v; el.appendChild(o); }); }
fill('f-failure', Object.keys(D.failure_kinds));
fill('f-env', [...new Set(D.episodes.map(e => e.env))].sort());
fill('f-version', [...new Set(D.episodes.flatMap(e => e.versions))].sort((a,b) => a-b));
function matches(e, q){
  const f = document.getElementById('f-failure').value, env = document.getElementById('f-env').value,
        v = document.getElementById('f-version').value;
  if ((f && e.failure != f) || (env && e.env != env) || (v !== '' && !e.versions.includes(+v))) return false;
  if (!q) return true;
  const m = q.match(/^reward\s*([<>]=?)\s*([-\d.]+)$/);
  if (m) { const x = parseFloat(m[2]); return m[1][0]=='>' ? e.reward > x || (m[1]=='>=' && e.reward==x) : e.reward < x || (m[1]=='<=' && e.reward==x); }
  return [e.id, e.env, e.stop, e.failure, e.infra_error].join(' ').toLowerCase().includes(q.toLowerCase());
}
function list(){
  const q = document.getElementById('filter').value.trim();
  document.querySelector('#eplist tbody').innerHTML = D.episodes.filter(e => matches(e, q)).map(e =>
    `<tr class="episode-row" data-id="${esc(e.id)}"><td>${esc(e.id)}</td><td>${e.iteration}</td><td>${e.reward.toFixed(3)}</td>`
    + `<td>${e.turns.length}</td><td class="${kindClass(e.failure)}" title="${esc(D.failure_kinds[e.failure]||'')}">${esc(e.failure)}</td></tr>`).join('');
  document.querySelectorAll('.episode-row').forEach(r => r.onclick = () => show(r.dataset.id));
  if (current) document.querySelectorAll('.episode-row').forEach(r => r.classList.toggle('sel', r.dataset.id == current.id));
}
function colour(lp){ const x = Math.max(0, Math.min(1, Math.exp(lp) * 4)); return `rgba(${Math.round(230*(1-x))},${Math.round(120+100*x)},80,0.35)`; }
function diverging(v, span){ const x = Math.max(-1, Math.min(1, v / span)); return x >= 0 ? `rgba(40,170,90,${0.1 + 0.5*x})` : `rgba(220,60,60,${0.1 - 0.5*x})`; }
let current = null;
const PAGE = 2000;  // tokens rendered at once: a long episode is paged, not drawn whole
let page = 0;
function tokenView(e){
  const by = document.getElementById('colour-by').value;
  const span = e.adv ? Math.max(1e-6, ...e.adv.map(Math.abs)) : 1;
  const pages = Math.max(1, Math.ceil(e.tokens.length / PAGE)), lo = page * PAGE;
  const nav = pages > 1 ? `<div id="token-pages">tokens ${lo}–${Math.min(e.tokens.length, lo + PAGE) - 1} of ${e.tokens.length} `
    + `<button id="prev" ${page ? '' : 'disabled'}>◀</button> page ${page + 1}/${pages} <button id="next" ${page + 1 < pages ? '' : 'disabled'}>▶</button></div>` : '';
  return nav + e.tokens.slice(lo, lo + PAGE).map((p,k) => { const i = lo + k;
    if (!e.mask[i]) return `<span class="tok ctx">${esc(p)}</span>`;
    const lr = e.learner ? e.learner[i] : null, ratio = lr === null ? null : Math.exp(lr - e.logprobs[i]);
    const bg = by == 'adv' && e.adv ? diverging(e.adv[i], span) : by == 'ratio' && ratio !== null ? diverging(Math.log(ratio), 0.2) : colour(e.logprobs[i]);
    const tip = `engine lp ${e.logprobs[i]}` + (lr === null ? '' : ` · learner lp ${lr} · ratio ${ratio.toFixed(4)} · advantage ${e.adv[i]}`);
    return `<span class="tok" style="background:${bg}" title="${tip}">${esc(p)}</span>`;
  }).join('');
}
// The token axis: turns as labelled boxes (red: the turn failed), milestones as green dots, sandbox limits as ⚠.
function timeline(e){
  const W = 760, scale = x => 10 + x / Math.max(1, e.n_tokens) * (W - 20);
  let g = `<svg id="timeline" width="${W}" height="74"><line x1="10" y1="30" x2="${W-10}" y2="30" stroke="#999"/>`;
  e.turns.forEach((t,i) => { const bad = (t.failures||[]).length, x = scale(t.gen_start), w = Math.max(2, scale(t.gen_end)-x), sum = t.kind == 'summary';
    g += `<rect class="turn-box${bad ? ' failed' : ''}${sum ? ' summary' : ''}" x="${x}" y="20" width="${w}" height="20" fill="${bad ? '#e88' : sum ? '#fc6' : '#9bd'}">`
      + `<title>turn ${i}${sum ? ' (summary)' : ''}: ${t.gen_end-t.gen_start} generated tokens${bad ? ' · ' + esc(t.failures.join(', ')) : ''}</title></rect>`
      + `<text x="${x + 2}" y="15" font-size="10">t${i}</text>`;
    if ((e.sample_turns||{})[i] !== undefined) g += `<line class="sample-start" x1="${scale(e.samples[e.sample_turns[i]])}" y1="12" x2="${scale(e.samples[e.sample_turns[i]])}" y2="48" stroke="#a60" stroke-dasharray="3,2"><title>${e.context == 'window' || e.context == 'compact' ? 'context segment' : 'sample'} ${e.sample_turns[i] + 1} starts</title></line>`;
    if ((t.sandbox_events||[]).length) g += `<text x="${x + w / 2}" y="35" font-size="12" text-anchor="middle">⚠<title>${esc(t.sandbox_events.join('; '))}</title></text>`;
  });
  e.milestones.forEach(m => g += `<circle r="6" fill="#2a8" cx="${scale(m.token)}" cy="30"><title>${esc(m.name)} +${m.reward}</title></circle>`
    + `<text x="${scale(m.token)}" y="56" font-size="10" text-anchor="middle">${esc(m.name)} +${m.reward}</text>`);
  return g + `<text x="10" y="70" font-size="10" fill="#555">token 0</text><text x="${W-10}" y="70" font-size="10" fill="#555" text-anchor="end">token ${e.n_tokens}</text></svg>`
    + `<div class="legend"><span><i class="sw" style="background:#9bd"></i>turn</span><span><i class="sw" style="background:#e88"></i>turn with a failure</span>`
    + `<span><i class="sw" style="background:#2a8;border-radius:5px"></i>milestone</span><span>⚠ sandbox limit</span>`
    + (e.turns.some(t => t.kind == 'summary') ? `<span><i class="sw" style="background:#fc6"></i>summary (compaction turn)</span>` : '')
    + ((e.samples||[]).length ? `<span><i class="sw" style="border-left:2px dashed #a60"></i>segment start</span>` : '') + `</div>`;
}
function turnHtml(e, t, i, departs){
  const fails = t.failures || [], opens = (e.sample_turns||{})[i];
  return (opens === undefined ? '' : `<div class="note sample">${esc((e.sample_notes||{})[i] || '')}</div>`)
    + `<div class="turn${departs ? ' departs' : ''}${t.kind == 'summary' ? ' summary' : ''}"><b>turn ${i}</b>${t.kind == 'summary' ? ' · <b class="summary">summary (compaction turn)</b>' : ''} · v${t.policy_version} · ${t.gen_end-t.gen_start} tokens · ${t.tool_calls} tool result(s), ${t.tool_errors} error(s) · ${esc(t.finish_reason)}`
    + (fails.length ? ` · <b class="fail">${fails.map(esc).join(', ')}</b>` : '')
    + (e.milestones.filter(m => m.turn == i).length ? ` · <b class="ok">milestones: ${e.milestones.filter(m => m.turn == i).map(m => esc(m.name)+' +'+m.reward).join(', ')}</b>` : '')
    + `<pre>${esc(t.text)}</pre></div>`
    + (t.observation ? `<div class="turn obs${fails.length || /^error:/m.test(t.observation) ? ' err' : ''}"><pre>${esc(t.observation)}</pre></div>` : '')
    + ((t.sandbox_events||[]).length ? `<div class="note">sandbox: ${t.sandbox_events.map(esc).join('; ')}</div>` : '');
}
function groupHtml(e){
  const g = D.groups[e.group]; if (!g) return '';
  const rows = g.episodes.map(r => `<tr class="group-row${r.episode_id == e.id ? ' sel' : ''}" data-id="${esc(r.episode_id)}"><td>${esc(r.episode_id)}${r.episode_id == g.best ? ' (best)' : ''}</td>`
    + `<td>${r.reward.toFixed(3)}</td><td>${r.advantage === null ? '–' : (r.advantage >= 0 ? '+' : '') + r.advantage.toFixed(3)}</td>`
    + `<td class="${kindClass(r.failure)}">${esc(r.failure)}</td><td>${r.episode_id == g.best ? '–' : r.diverges_at_turn === null ? 'same tokens' : 'turn ' + r.diverges_at_turn}</td>`
    + `<td>${r.turns.map((c,i) => `<span class="${TURN_FAILS.includes(c) || c.includes('[') ? 'fail' : ''}${i === r.diverges_at_turn ? ' departs' : ''}">${esc(c)}</span>`).join(' → ')}</td></tr>`).join('');
  let out = `<h2 id="group-title">group ${e.group}: ${g.episodes.length} episode(s), best first</h2>`
    + `<table id="group"><thead><tr><th>episode</th><th>reward</th><th>advantage</th><th>failure</th><th>departs from best</th><th>tools per turn</th></tr></thead><tbody>${rows}</tbody></table>`;
  const best = D.episodes.find(x => x.id == g.best), mine = g.episodes.find(r => r.episode_id == e.id);
  if (best && best.id != e.id) {
    const from = mine.diverges_at_turn === null ? Infinity : mine.diverges_at_turn, n = Math.max(e.turns.length, best.turns.length);
    let pair = `<div class="pair"><div class="head">${esc(e.id)} · reward ${e.reward} · ${esc(e.failure)}</div><div class="head">${esc(best.id)} (best) · reward ${best.reward} · ${esc(best.failure)}</div>`;
    for (let i = 0; i < n; i++) pair += `<div>${e.turns[i] ? turnHtml(e, e.turns[i], i, i >= from) : ''}</div><div>${best.turns[i] ? turnHtml(best, best.turns[i], i, i >= from) : ''}</div>`;
    out += `<h2>this episode next to the best of its group</h2><div class="note">${from === Infinity ? 'the same tokens as the best' : 'outlined: from turn ' + from + ', where the two first differ'}</div>${pair}</div>`;
  }
  return out;
}
function show(id){
  const e = D.episodes.find(x => x.id == id); if (!e) return;
  current = e; page = 0;
  document.querySelectorAll('.episode-row').forEach(r => r.classList.toggle('sel', r.dataset.id == id));
  document.getElementById('episode').innerHTML = `<h1 id="episode-title">${esc(e.id)}</h1>`
    + `<div>${esc(e.env)} · seed ${e.seed} · group ${e.group} · reward ${e.reward} · stop ${esc(e.stop)} · `
    + `<b class="${kindClass(e.failure)}" title="${esc(D.failure_kinds[e.failure]||'')}">${esc(e.failure)}</b> · ${e.n_tokens} tokens (${e.n_generated} generated)${(e.samples||[]).length ? ` · ${e.samples.length} ${e.context == 'window' || e.context == 'compact' ? 'context segments (' + esc(e.context) + ')' : 'samples'}` : ''}`
    + (e.infra_error ? ` · <span class="note">infra error: ${esc(e.infra_error)}</span>` : '') + `</div>`
    + (Object.keys(e.reward_parts || {}).length ? `<div id="reward-parts">reward parts: ${Object.entries(e.reward_parts).map(([k, v]) => esc(k) + ' ' + (+v).toFixed(3)).join(' · ')}</div>` : '')
    + `<h2>task</h2><pre>${esc(e.task)}</pre>`
    + groupHtml(e)
    + `<h2>timeline</h2>${timeline(e)}<h2>turns</h2>${e.turns.map((t,i) => turnHtml(e, t, i, false)).join('')}`
    + `<h2>tokens</h2><div class="note">${e.cut ? 'first tokens only; ' : ''}context grey; generated tokens coloured by the chosen value`
    + (e.learner ? '' : ' (no learner record: not trained on)') + `</div><div id="tokens"></div>`;
  document.querySelectorAll('.group-row').forEach(r => r.onclick = () => show(r.dataset.id));
  redraw();
}
function redraw(){
  document.getElementById('tokens').innerHTML = tokenView(current);
  const prev = document.getElementById('prev'), next = document.getElementById('next');
  if (prev) prev.onclick = () => { page--; redraw(); };
  if (next) next.onclick = () => { page++; redraw(); };
}
document.getElementById('colour-by').onchange = () => { if (current) redraw(); };
['filter', 'f-failure', 'f-env', 'f-version'].forEach(id => document.getElementById(id).oninput = list);
const start = new URLSearchParams(location.search);  // ?failure=no_tool_call&episode=ID: a page opened on a view
if (start.get('failure')) document.getElementById('f-failure').value = start.get('failure');
list();
const first = start.get('episode') || (document.querySelector('.episode-row') || {dataset: {}}).dataset.id || (D.episodes[0] || {}).id;
if (first) show(first);
</script></body></html>
"""

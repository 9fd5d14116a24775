"""`longhorizon inspect DIR --html OUT.html`: one self-contained page (no network, no server).

The page holds the run summary (a reward curve), the episode list with a filter, and for the
selected episode its turns (generated text, tool results, sandbox events), a milestone timeline
along the token axis and a per-token heat map of the generated tokens coloured by the engine's
log-prob, the learner/engine ratio or the advantage (from the learner records), context grey. Data is embedded as JSON and rendered by a small script.

Limits: at most `max_episodes` episodes (the newest, each read alone from the store) and
`max_tokens` tokens per episode are embedded, so a page stays small for long runs; the page says
when it cut something. Tokens are drawn a page of 2,000 at a time.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from longhorizon.inspect import run_tokenizer, summary
from rl.store import TrajectoryStore


def episode_payload(t, tok, max_tokens: int, learner: dict | None = None) -> dict:
    n = min(len(t.token_ids), max_tokens)
    pieces = (tok.convert_ids_to_tokens(t.token_ids[:n]) if tok is not None else [str(i) for i in t.token_ids[:n]])
    pieces = [p.replace("Ġ", " ").replace("Ċ", "\n") if isinstance(p, str) else str(p) for p in pieces]
    return {
        "id": t.episode_id, "iteration": t.iteration, "group": t.group_id, "env": t.env_id, "seed": t.seed,
        "reward": t.reward, "stop": t.stop_reason, "infra_error": t.infra_error, "task": t.task,
        "n_tokens": len(t.token_ids), "n_generated": t.num_generated, "cut": n < len(t.token_ids),
        "tokens": pieces, "mask": t.loss_mask[:n], "logprobs": [round(x, 4) for x in t.rollout_logprobs[:n]],
        "turns": [vars(turn) for turn in t.turns],
        "milestones": t.milestones,
        # the learner's pre-update log-probs and the advantages it trained with, when it trained on it
        "learner": [round(x, 4) for x in learner["learner_logprobs"][:n]] if learner else None,
        "adv": [round(x, 4) for x in learner["advantages"][:n]] if learner else None,
    }


def write_html(run_dir: str | Path, out: str | Path, max_episodes: int = 500, max_tokens: int = 100_000) -> Path:
    run_dir = Path(run_dir)
    s = summary(run_dir)
    tok = run_tokenizer(run_dir)
    store = TrajectoryStore(run_dir)
    # the newest `max_episodes`, read a few columns first so only those episodes are ever loaded whole
    ids = [r["episode_id"] for r in store.rows(["episode_id"], strict=False)]
    shown = set(ids[-max_episodes:])
    learner = {r["episode_id"]: r for r in store.learner_records() if r["episode_id"] in shown}
    payloads = [episode_payload(t, tok, max_tokens, learner.get(t.episode_id)) for t in store.episodes(ids[-max_episodes:])]
    data = {"summary": s, "episodes": payloads, "episodes_cut": len(ids) > max_episodes}
    blob = json.dumps(data).replace("</", "<\\/")  # keep "</script>" out of the JSON
    page = _TEMPLATE.replace("__TITLE__", html.escape(str(run_dir))).replace("__DATA__", blob)
    out = Path(out)
    out.write_text(page, encoding="utf-8")
    return out


_TEMPLATE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>longhorizon · __TITLE__</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;color:#222;display:grid;grid-template-columns:420px 1fr;height:100vh}
#left{border-right:1px solid #ddd;overflow:auto;padding:12px} #right{overflow:auto;padding:12px 20px}
h1{font-size:16px;margin:0 0 8px} h2{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;width:100%} td,th{padding:3px 6px;border-bottom:1px solid #eee;text-align:left}
tr.episode-row{cursor:pointer} tr.episode-row:hover{background:#f3f6ff} tr.sel{background:#e3ebff}
input{width:100%;padding:5px;margin:6px 0;box-sizing:border-box}
.turn{border:1px solid #cfe0ff;border-radius:6px;margin:8px 0;padding:6px 10px}
.obs{border-color:#ddd;background:#fafafa} pre{white-space:pre-wrap;margin:4px 0;font:12px ui-monospace,monospace}
.tok{font:12px ui-monospace,monospace;white-space:pre-wrap;border-radius:2px}
.ctx{color:#888} .ms{fill:#2a8} .note{color:#a60}
</style></head><body>
<div id="left"><h1>__TITLE__</h1><div id="runsum"></div><svg id="curve" width="390" height="120"></svg>
<input id="filter" placeholder="filter: id, env, stop reason, reward>0.5 ...">
<table id="eplist"><thead><tr><th>episode</th><th>iter</th><th>reward</th><th>turns</th><th>stop</th></tr></thead><tbody></tbody></table></div>
<div id="right"><div>colour tokens by <select id="colour-by"><option value="lp">engine log-prob (green: likely)</option>
<option value="ratio">learner / engine ratio (green &gt; 1, red &lt; 1)</option><option value="adv">advantage (green &gt; 0, red &lt; 0)</option></select></div>
<div id="episode">select an episode</div></div>
<script id="data" type="application/json">__DATA__</script>
<script>
const D = JSON.parse(document.getElementById('data').textContent);
const esc = s => String(s).replace(/[&<>]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;'}[c]));
const S = D.summary;
document.getElementById('runsum').innerHTML = `${S.iterations} iterations · ${S.episodes} episodes · policy versions ${S.policy_versions.join(', ')}`
  + (D.episodes_cut ? `<div class="note">showing the newest ${D.episodes.length} episodes</div>` : '')
  + (Object.keys(S.corrupt_shards||{}).length ? `<div class="note">corrupt shards skipped: ${Object.keys(S.corrupt_shards).join(', ')}</div>` : '');
(function curve(){
  const r = S.mean_reward, svg = document.getElementById('curve'), W = 380, H = 100;
  if (!r.length) return;
  const lo = Math.min(0, ...r), hi = Math.max(1e-9, ...r);
  const pts = r.map((v,i) => `${10 + (r.length>1 ? i*(W-20)/(r.length-1) : W/2)},${H - 10 - (v-lo)/(hi-lo)*(H-20)}`);
  svg.innerHTML = `<text x="10" y="12" font-size="11">mean reward per iteration (${lo.toFixed(2)} … ${hi.toFixed(2)})</text>`
    + `<polyline fill="none" stroke="#36c" stroke-width="2" points="${pts.join(' ')}"/>`
    + pts.map(p => `<circle r="3" fill="#36c" cx="${p.split(',')[0]}" cy="${p.split(',')[1]}"/>`).join('');
})();
function matches(e, q){
  if (!q) return true;
  const m = q.match(/^reward\s*([<>]=?)\s*([-\d.]+)$/);
  if (m) { const v = parseFloat(m[2]); return m[1][0]=='>' ? e.reward > v || (m[1]=='>=' && e.reward==v) : e.reward < v || (m[1]=='<=' && e.reward==v); }
  return [e.id, e.env, e.stop, e.infra_error].join(' ').toLowerCase().includes(q.toLowerCase());
}
function list(){
  const q = document.getElementById('filter').value.trim();
  document.querySelector('#eplist tbody').innerHTML = D.episodes.filter(e => matches(e, q)).map(e =>
    `<tr class="episode-row" data-id="${esc(e.id)}"><td>${esc(e.id)}</td><td>${e.iteration}</td><td>${e.reward.toFixed(3)}</td><td>${e.turns.length}</td><td>${esc(e.stop)}</td></tr>`).join('');
  document.querySelectorAll('.episode-row').forEach(r => r.onclick = () => show(r.dataset.id));
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
function show(id){
  const e = D.episodes.find(x => x.id == id); if (!e) return;
  document.querySelectorAll('.episode-row').forEach(r => r.classList.toggle('sel', r.dataset.id == id));
  const byTurn = {}; e.milestones.forEach(m => (byTurn[m.turn] = byTurn[m.turn] || []).push(m));
  const W = 700, scale = x => 10 + x / Math.max(1, e.n_tokens) * (W - 20);
  const timeline = `<svg width="${W}" height="46"><line x1="10" y1="24" x2="${W-10}" y2="24" stroke="#999"/>`
    + e.turns.map((t,i) => `<rect x="${scale(t.gen_start)}" y="16" width="${Math.max(1, scale(t.gen_end)-scale(t.gen_start))}" height="16" fill="#9bd" ><title>turn ${i}</title></rect>`).join('')
    + e.milestones.map(m => `<circle class="ms" r="6" cx="${scale(m.token)}" cy="24"><title>${esc(m.name)} +${m.reward}</title></circle><text x="${scale(m.token)-10}" y="44" font-size="10">${esc(m.name)}</text>`).join('')
    + `</svg>`;
  const turns = e.turns.map((t,i) => `<div class="turn"><b>turn ${i}</b> · v${t.policy_version} · ${t.gen_end-t.gen_start} tokens · ${t.tool_calls} tool result(s), ${t.tool_errors} error(s) · ${esc(t.finish_reason)}`
    + (byTurn[i] ? ` · <b>milestones: ${byTurn[i].map(m => esc(m.name)+' +'+m.reward).join(', ')}</b>` : '')
    + `<pre>${esc(t.text)}</pre></div>` + (t.observation ? `<div class="turn obs"><pre>${esc(t.observation)}</pre></div>` : '')
    + ((t.sandbox_events||[]).length ? `<div class="note">sandbox: ${t.sandbox_events.map(esc).join('; ')}</div>` : '')).join('');
  current = e; page = 0;
  document.getElementById('episode').innerHTML = `<h1 id="episode-title">${esc(e.id)}</h1>`
    + `<div>${esc(e.env)} · seed ${e.seed} · reward ${e.reward} · stop ${esc(e.stop)} · ${e.n_tokens} tokens (${e.n_generated} generated)`
    + (e.infra_error ? ` · <span class="note">infra error: ${esc(e.infra_error)}</span>` : '') + `</div>`
    + `<h2>milestone timeline</h2>${timeline}<h2>turns</h2><div><i>task:</i> ${esc(e.task)}</div>${turns}`
    + `<h2>tokens</h2><div class="note">${e.cut ? 'first tokens only; ' : ''}context grey; generated tokens coloured by the chosen value`
    + (e.learner ? '' : ' (no learner record: not trained on)') + `</div><div id="tokens"></div>`;
  redraw();
}
function redraw(){
  document.getElementById('tokens').innerHTML = tokenView(current);
  const prev = document.getElementById('prev'), next = document.getElementById('next');
  if (prev) prev.onclick = () => { page--; redraw(); };
  if (next) next.onclick = () => { page++; redraw(); };
}
document.getElementById('colour-by').onchange = () => { if (current) redraw(); };
document.getElementById('filter').oninput = list;
list();
if (D.episodes.length) show(D.episodes[0].id);
</script></body></html>
"""

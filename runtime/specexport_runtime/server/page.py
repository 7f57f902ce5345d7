"""The web page at `/` (`serve --no-web-page` turns it off): a chat that streams with `trace: true`
and colours each token by how it came (trace.py: accepted draft, correction, bonus, forced by the
grammar, plain target step), with live tokens per target call and tok/s, the proposer and the
gamma policy, and the request's `speculative` report block at the end. One self-contained HTML
document: no external script, style or font, so it works on an offline device. `?prompt=TEXT`
(and optionally `max_tokens`, `temperature`, `proposer`) sends that prompt once the page loads.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>specexport</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 60rem; padding: 1rem; color: #222; }
textarea { width: 100%; height: 5rem; font: inherit; }
.row { display: flex; gap: .8rem; align-items: center; flex-wrap: wrap; margin: .4rem 0; }
#answer { white-space: pre-wrap; border: 1px solid #ccc; border-radius: 4px; padding: .6rem; min-height: 4rem; }
.tok { border-radius: 2px; }
.k-accepted { background: #c8f0c8; } .k-correction { background: #ffd0c0; } .k-bonus { background: #c8dcff; }
.k-forced { background: #e6d0ff; } .k-target { background: #eeeeee; }
#stats span { margin-right: 1.2rem; } #report { font-size: 12px; background: #f6f6f6; padding: .5rem; overflow: auto; }
.legend span { padding: 0 .4rem; margin-right: .4rem; }
</style></head>
<body>
<h2>specexport</h2>
<div class="legend">
<span class="tok k-accepted">accepted draft</span><span class="tok k-correction">correction</span>
<span class="tok k-bonus">bonus</span><span class="tok k-forced">forced by the grammar</span>
<span class="tok k-target">target step</span></div>
<textarea id="prompt" placeholder="Ask something"></textarea>
<div class="row">
<label>max tokens <input id="max_tokens" type="number" value="256" min="1" style="width:5rem"></label>
<label>temperature
<input id="temperature" type="number" value="0" min="0" max="2" step="0.1" style="width:4rem"></label>
<label>proposer <input id="proposer" placeholder="server default" style="width:8rem"></label>
<label>API key <input id="key" type="password" style="width:10rem"></label>
<button id="send">Send</button> <span id="status">ready</span></div>
<div id="answer"></div>
<div id="stats" class="row"><span id="s-tokens">tokens 0</span><span id="s-calls">tokens per target call -</span>
<span id="s-toks">tok/s -</span><span id="s-accept">acceptance -</span><span id="s-proposer">proposer -</span>
<span id="s-gamma">gamma -</span></div>
<pre id="report"></pre>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function setText(id, text) { $(id).textContent = text; }
async function send() {
  const answer = $("answer");
  answer.textContent = ""; $("report").textContent = ""; setText("status", "waiting");
  const body = {messages: [{role: "user", content: $("prompt").value}], stream: true, trace: true,
    stream_options: {include_usage: true}, max_tokens: Number($("max_tokens").value),
    temperature: Number($("temperature").value)};
  if ($("proposer").value) body.proposer = $("proposer").value;
  const headers = {"Content-Type": "application/json"};
  if ($("key").value) headers.Authorization = "Bearer " + $("key").value;
  const start = performance.now();
  let tokens = 0, calls = 0, buffer = "";
  const resp = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
  if (!resp.ok) {
    const err = await resp.json().catch(() => ({}));
    setText("status", "error " + resp.status + ": " + ((err.error || {}).message || resp.statusText));
    return;
  }
  setText("status", "streaming");
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") { setText("status", "done"); continue; }
      const chunk = JSON.parse(data);
      if (chunk.error) { setText("status", "error: " + chunk.error.message); continue; }
      for (const item of chunk.trace || []) {
        const span = document.createElement("span");
        span.className = "tok k-" + item.kind; span.textContent = item.text; span.title = item.kind;
        answer.appendChild(span);
        tokens += 1;
        if (item.kind !== "accepted" && item.kind !== "forced") calls += 1;  // each round ends with a target token
      }
      const seconds = (performance.now() - start) / 1000;
      setText("s-tokens", "tokens " + tokens);
      if (calls) setText("s-calls", "tokens per target call " + (tokens / calls).toFixed(2));
      if (seconds > 0) setText("s-toks", "tok/s " + (tokens / seconds).toFixed(1));
      const spec = chunk.speculative;
      if (spec) {
        setText("s-accept", "acceptance " + (100 * spec.acceptance_rate).toFixed(1) + "%");
        setText("s-proposer", "proposer " + spec.proposer);
        setText("s-gamma", "gamma " + (spec.gamma === null ? spec.gamma_policy : spec.gamma));
        setText("s-toks", "tok/s " + spec.decode_tokens_per_second.toFixed(1) + " (decode)");
        $("report").textContent = JSON.stringify(spec, null, 1);
      }
    }
  }
  if ($("status").textContent !== "done") setText("status", "ended");
}
$("send").addEventListener("click", () => send().catch((e) => setText("status", "error: " + e)));
const params = new URLSearchParams(location.search);
for (const name of ["max_tokens", "temperature", "proposer"]) if (params.has(name)) $(name).value = params.get(name);
if (params.has("prompt")) {
  $("prompt").value = params.get("prompt");
  send().catch((e) => setText("status", "error: " + e));
}
</script>
</body></html>
"""


async def web_page(request: Request) -> HTMLResponse:
    """GET /: the page (no key needed: the page itself holds no data; its requests carry the key)."""
    return HTMLResponse(PAGE, headers={"cache-control": "no-cache"})

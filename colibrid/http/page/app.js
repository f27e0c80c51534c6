// The colibri page: chat through this daemon's OpenAI endpoint, and its memory tiers from
// GET /colibri/status once a second. Plain JS, no build step, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const GB = (x) => (x == null ? "–" : `${x.toFixed(2)} GB`);
const SIZE = (bytes) =>
  bytes >= 2 ** 30 ? GB(bytes / 2 ** 30) : `${(bytes / 2 ** 20).toFixed(bytes ? 2 : 0)} MB`;
const PCT = (x) => (x == null ? "–" : `${(100 * x).toFixed(1)}%`);

let messages = []; // the conversation so far, as /v1/chat/completions takes it
let running = null; // the AbortController of the answer being streamed
let loaded = null; // the model the daemon has loaded (chosen in the model list first)

// ---- talking to the daemon ------------------------------------------------------------
function headers(json) {
  const h = {};
  if (json) h["content-type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

async function failure(response) {
  // the daemon's errors are {"error": {"message": ...}}
  let text = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    text += `: ${body.error.message || body.error}`;
  } catch (_) {
    /* not JSON: the status says it */
  }
  return new Error(text);
}

async function getJson(path) {
  const response = await fetch(path, { headers: headers(false) });
  if (!response.ok) throw await failure(response);
  return response.json();
}

async function postJson(path, body, signal) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers(true),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await failure(response);
  return response;
}

// ---- chat ------------------------------------------------------------------------------
function bubble(role, text) {
  const item = document.createElement("div");
  item.className = `msg ${role}`;
  const who = document.createElement("strong");
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  item.append(who, body);
  $("log").append(item);
  return item;
}

// The data: payloads of a server-sent-event stream, as they arrive (comments skipped).
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (data) yield data;
    }
  }
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || running) return;
  $("chat-error").textContent = "";
  messages.push({ role: "user", content: prompt });
  bubble("user", prompt);
  $("prompt").value = "";
  const answer = bubble("assistant", "");
  answer.dataset.state = "streaming";
  const text = answer.querySelector(".text");
  const request = {
    model: $("model").value,
    messages,
    stream: true,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("json-mode").checked) request.response_format = { type: "json_object" };
  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let reply = "";
  try {
    const response = await postJson("/v1/chat/completions", request, running.signal);
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices[0];
      if (choice && choice.delta.content) {
        reply += choice.delta.content;
        text.textContent = reply;
      }
      if (choice && choice.finish_reason) answer.dataset.finish = choice.finish_reason;
    }
    answer.dataset.state = "done";
  } catch (error) {
    answer.dataset.state = error.name === "AbortError" ? "stopped" : "error";
    if (error.name !== "AbortError") $("chat-error").textContent = error.message;
  } finally {
    if (answer.dataset.state === "stopped") text.textContent = `${reply} [stopped]`;
    if (answer.dataset.state === "error") messages.pop(); // the turn did not happen
    else messages.push({ role: "assistant", content: reply }); // a stopped one did, in part
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

async function loadModels() {
  try {
    const list = await getJson("/v1/models");
    const select = $("model");
    const current = select.value || loaded;
    select.replaceChildren(
      ...list.data.map((m) => new Option(m.id, m.id, false, m.id === current)),
    );
  } catch (error) {
    $("chat-error").textContent = error.message;
  }
}

// ---- tiers -----------------------------------------------------------------------------
// The disk, memory and kernel limits the daemon measured for this model, and the last
// request's share of each (docs/performance.md "The live roofline").
function ceilings(c) {
  if (!c) return "–";
  const disk = c.disk_gbs == null ? "no disk reads" : `disk ${c.disk_gbs.toFixed(2)} GB/s`;
  const kernels = c.kernel_tok_s == null ? "" : `, kernels ${c.kernel_tok_s.toFixed(1)} tok/s`;
  return `${disk}, memory ${c.memory_gbs.toFixed(1)} GB/s${kernels}`;
}

function shares(last) {
  if (!last) return "–";
  const disk = last.disk_share == null ? "" : `disk ${PCT(last.disk_share)}, `;
  const kernels = last.kernel_share == null ? "" : `, kernels ${PCT(last.kernel_share)}`;
  return (
    `${disk}memory ${PCT(last.memory_share)}${kernels}: ` +
    `${PCT(last.roofline_share)} of the roofline (${last.bound}-bound), ` +
    `${last.read_mb_tok.toFixed(1)} MB read a token`
  );
}

function figures(status) {
  const t = status.tiers;
  const store = t.store || {};
  const ram = t.ram;
  const cached = ram.pinned == null ? ram.experts : ram.experts - ram.pinned;
  const rows = [
    ["Model", `${status.model || "none"} (${status.backend || "–"})`],
    ["Profile", status.profile || "–"],
    ["Precision plan", status.plan ? status.plan.id : "–"],
    ["Pinned in RAM", `${ram.pinned ?? 0} experts, ${GB(ram.pinned_gb ?? 0)}`],
    ["Cached in RAM", `${cached} experts`],
    ["On the device", `${t.vram.experts} experts, ${GB(t.vram.gb)}`],
    ["On disk only", `${t.disk.experts} experts, ${GB(t.disk.gb)}`],
    ["Hit rate", PCT(status.hit_rate)],
    ["PILOT recall", PCT(store.pilot_recall)],
    ["Read a token", store.bytes_per_token == null ? "–" : SIZE(store.bytes_per_token)],
    ["Last tok/s", String(status.last_tok_s)],
    ["Ceilings (probed)", ceilings(status.roofline.ceilings)],
    ["Last request's roofline", shares(status.roofline.last)],
    ["Requests", `${status.running} running, ${status.queued} queued, ${status.requests_done} done`],
  ];
  $("figures").replaceChildren(
    ...rows.flatMap(([name, value]) => {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value;
      return [dt, dd];
    }),
  );
  $("daemon").textContent =
    `colibrid ${status.version}, up ${Math.round(status.uptime_s)} s` +
    (status.loading ? `, loading ${status.loading}` : "");
}

function heatMap(heat, pinned) {
  const table = $("heat");
  if (!heat) {
    table.replaceChildren();
    return;
  }
  const pins = new Set(pinned.map(([layer, expert]) => `${layer}:${expert}`));
  const top = Math.max(1, ...heat.counts.flat());
  const experts = heat.counts.length ? heat.counts[0].length : 0;
  const head = document.createElement("tr");
  head.append(document.createElement("th"));
  for (let e = 0; e < experts; e++) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = e;
    head.append(th);
  }
  const rows = heat.layers.map((layer, i) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = `L${layer}`;
    tr.append(th);
    heat.counts[i].forEach((count, e) => {
      const td = document.createElement("td");
      // log scale: a few hot experts must not flatten the rest to zero
      const level = count ? Math.min(9, Math.ceil((9 * Math.log1p(count)) / Math.log1p(top))) : 0;
      const pinnedHere = pins.has(`${layer}:${e}`);
      td.className = `l${level}${pinnedHere ? " pinned" : ""}`;
      td.textContent = `${level}${pinnedHere ? "P" : ""}`;
      td.title = `layer ${layer}, expert ${e}: ${count} selections${pinnedHere ? ", pinned" : ""}`;
      td.dataset.count = count;
      tr.append(td);
    });
    return tr;
  });
  table.dataset.profile = heat.profile;
  table.dataset.total = heat.counts.flat().reduce((a, b) => a + b, 0);
  table.dataset.pinned = pinned.length;
  table.replaceChildren(head, ...rows);
}

function profiles(list) {
  const select = $("profile");
  if (document.activeElement === select) return; // the user is choosing: leave it be
  const shown = list.map((p) => `${p.name} (${p.selections} selections)`);
  if (select.dataset.shown === shown.join("\n")) return;
  // keep what the user picked; the active profile on the first draw and after a switch
  const active = list.find((p) => p.active);
  const chosen = select.dataset.shown ? select.value : active && active.name;
  select.dataset.shown = shown.join("\n");
  select.replaceChildren(
    ...list.map((p, i) => new Option(shown[i], p.name, false, p.name === chosen)),
  );
}

async function poll() {
  try {
    const snap = await getJson("/colibri/status");
    figures(snap.status);
    heatMap(snap.heat, snap.status.pinned);
    profiles(snap.profiles);
    loaded = snap.status.model;
    if (!$("model").options.length) await loadModels(); // after `loaded`: it is chosen first
    $("tiers-error").textContent = "";
  } catch (error) {
    $("tiers-error").textContent = error.message;
  }
  setTimeout(poll, 1000);
}

async function useProfile(event) {
  event.preventDefault();
  $("tiers-error").textContent = "";
  $("use-profile").disabled = true;
  try {
    await postJson("/colibri/profile", { name: $("profile").value });
    delete $("profile").dataset.shown; // redraw the list, the new active one chosen
  } catch (error) {
    $("tiers-error").textContent = error.message;
  } finally {
    $("use-profile").disabled = false;
  }
}

// ---- start -------------------------------------------------------------------------------
$("ask").addEventListener("submit", send);
$("stop").addEventListener("click", () => running && running.abort());
$("clear").addEventListener("click", () => {
  if (running) running.abort();
  messages = [];
  $("log").replaceChildren();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault(); // Enter sends, Shift+Enter starts a new line
    $("ask").requestSubmit();
  }
});
$("profile-form").addEventListener("submit", useProfile);
poll();

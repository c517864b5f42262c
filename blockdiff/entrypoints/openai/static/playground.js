"use strict";
// The blockdiff playground. It chats through this server's /v1/chat/completions with draft
// streaming (stream_drafts, draft_details: docs/server.md) and shows the canvas being denoised as a
// grid of token cells, one frame per denoising step; the committed text grows above it. Every
// call goes to this server, with the API key when the server has one (kept in session storage).
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORAGE = "blockdiff-api-key";
  const FIELDS = ["max_denoising_steps", "entropy_bound", "temperature", "seed", "max_tokens"];
  const STATE_WORDS = {
    renoised: "renoised (noise again next step)", accepted: "accepted this step", settled: "settled (accepted, unchanged)",
    committed: "committed", dropped: "dropped (after the end of the output)",
  };
  const STATE_MARKS = { renoised: "~", accepted: "+", settled: "=", committed: "", dropped: "x" };
  const keyRequired = document.body.dataset.apiKey === "required";

  let card = null; // this server's first model card (/v1/models): id, canvas_length, sampling_defaults
  let conversation = []; // the messages sent with the next turn
  let running = null; // the turn in progress: {controller}
  let autorun = false;
  let run = null; // the canvases of the latest turn
  const tokenText = new Map(); // token id -> its text, learnt from the drafts
  const userSet = new Set(); // controls given by the URL, which the server's defaults do not overwrite

  class APIError extends Error {
    constructor(status, message, code) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  // ---- calls to the server ---------------------------------------------------------------------
  function apiKey() {
    return sessionStorage.getItem(KEY_STORAGE);
  }

  async function api(path, options = {}) {
    const headers = { ...(options.headers || {}) };
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    let response;
    try {
      response = await fetch(path, { ...options, headers });
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new APIError(0, `cannot reach the server (${e.message})`, null);
    }
    if (!response.ok) throw await errorOf(response);
    return response;
  }

  async function errorOf(response) {
    let message = `${response.status} ${response.statusText}`;
    let code = null;
    try {
      const body = await response.json();
      if (body.error) ({ message, code } = body.error);
    } catch (_) { /* not an OpenAI error body: keep the status line */ }
    return new APIError(response.status, message, code);
  }

  // Server-sent events of a streamed response -> {name, data}, until data: [DONE].
  async function* events(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let name = "message";
        let data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data += line.slice(5).trimStart();
        }
        if (data === "[DONE]") return;
        if (data) yield { name, data: JSON.parse(data) };
      }
    }
  }

  // ---- messages ----------------------------------------------------------------------------------
  function showAlert(text) {
    $("alert").textContent = text;
  }

  function explain(e) {
    if (e.status === 401) {
      return apiKey()
        ? `The server refused this API key (401: ${e.message}). Enter the right key above.`
        : `This server needs an API key, and none was sent (401: ${e.message}). Enter the key above.`;
    }
    if (e.status === 0) return `The request failed: ${e.message}.`;
    return `The request failed (${e.status || "stream"}${e.code ? `, ${e.code}` : ""}): ${e.message}`;
  }

  function fail(e) {
    const text = explain(e);
    showAlert(text);
    if (e.status === 401) askKey(text);
    return text;
  }

  function askKey(text) {
    $("key-form").hidden = false;
    $("key-message").textContent = text || "";
    $("key-input").value = "";
    $("key-input").focus();
  }

  // ---- start: key, model card, defaults ------------------------------------------------------------
  async function connect() {
    try {
      const list = await (await api("/v1/models")).json();
      card = list.data[0];
    } catch (e) {
      fail(e);
      if (e.status === 401) sessionStorage.removeItem(KEY_STORAGE); // a refused key is not kept
      $("model").textContent = "not connected";
      return;
    }
    $("key-form").hidden = true;
    showAlert("");
    $("model").textContent = `model ${card.id} · canvas of ${card.canvas_length} tokens · context ${card.max_model_len}`;
    fillDefaults(false);
    pollStats();
    if (autorun) {
      autorun = false;
      send();
    }
  }

  // Whether this server's sampler takes a control's field: its defaults name the sampler's fields
  // (a confidence-threshold server has no entropy bound and no temperature schedule).
  function offered(name) {
    const d = card?.sampling_defaults;
    if (!d || name === "seed" || name === "max_tokens") return true;
    return name === "temperature" ? "t_min" in d : name in d;
  }

  function fillDefaults(all) {
    if (!card) return;
    const d = card.sampling_defaults;
    const values = { max_denoising_steps: d.max_denoising_steps, entropy_bound: d.entropy_bound, temperature: 1,
                     seed: "", max_tokens: d.max_tokens ?? "" };
    for (const name of FIELDS) {
      control(name).closest("label").hidden = !offered(name);
      if (all || !userSet.has(name)) control(name).value = values[name];
    }
    if (all) userSet.clear();
    showSchedule();
  }

  function control(name) {
    return $("controls").elements[name];
  }

  function showSchedule() {
    if (!card) return;
    const d = card.sampling_defaults;
    $("schedule").hidden = !offered("temperature");
    if (!offered("temperature")) return;
    const raw = control("temperature").value.trim();
    const t = raw === "" ? 1 : Number(raw) || 1e-6; // temperature 0 is greedy: the schedule scaled by 1e-6
    $("schedule").textContent = `denoising temperature ${fmt(d.t_max * t)} at the first step, falling to ${fmt(d.t_min * t)}`;
  }

  function fmt(x) {
    return Number(x.toPrecision(3)).toString();
  }

  function controlValues() {
    const out = {};
    for (const name of FIELDS.filter(offered)) {
      const raw = control(name).value.trim();
      if (raw !== "" && !Number.isNaN(Number(raw))) out[name] = Number(raw);
    }
    return out;
  }

  // ---- one chat turn -------------------------------------------------------------------------------
  async function send() {
    const text = $("prompt").value.trim();
    if (!text || running) return;
    showAlert("");
    conversation.push({ role: "user", content: text });
    addMessage("user").body.textContent = text;
    $("prompt").value = "";
    const reply = addMessage("assistant");
    reply.body.textContent = "…";
    reply.body.classList.add("pending");
    const params = controlValues();
    run = { canvas: -1, committed: 0, base: 0, lastSteps: 0, history: [],
            maxSteps: params.max_denoising_steps ?? card?.sampling_defaults.max_denoising_steps };
    const body = { messages: conversation, stream: true, stream_drafts: true, draft_details: true, return_token_ids: true,
                   stream_options: { include_usage: true }, ...params };
    if (card) body.model = card.id;
    const controller = new AbortController();
    running = { controller };
    setRunning(true);
    $("finish").textContent = "";
    const t0 = performance.now();
    let content = "";
    let finishReason = null;
    let usage = null;
    let outcome;
    try {
      const response = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal,
      });
      for await (const { name, data } of events(response)) {
        if (name === "draft") {
          onDraft(data.choices[0]);
        } else if (data.error) {
          throw new APIError(null, data.error.message, data.error.code);
        } else if (data.choices.length) {
          const choice = data.choices[0];
          content += addDelta(reply, choice.delta);
          if (choice.token_ids) await onCommit(choice.token_ids);
          if (choice.finish_reason) finishReason = choice.finish_reason;
        } else if (data.usage) {
          usage = data.usage;
        }
      }
      const seconds = (performance.now() - t0) / 1000;
      outcome = `finish reason: ${finishReason ?? "none"}`;
      if (usage) {
        const u = usage.diffusion;
        outcome += ` · ${u.canvases} canvas${u.canvases === 1 ? "" : "es"}, ${u.denoising_steps} steps, ` +
                   `${usage.completion_tokens} tokens in ${seconds.toFixed(2)} s`;
      }
      conversation.push({ role: "assistant", content });
    } catch (e) {
      conversation.pop(); // a turn that did not finish is left out of the conversation
      if (e.name === "AbortError") {
        outcome = "stopped";
      } else {
        outcome = "error";
        fail(e);
      }
      if (!$("prompt").value) $("prompt").value = text;
    } finally {
      running = null;
      setRunning(false);
    }
    if (reply.body.classList.contains("pending")) reply.body.textContent = outcome === "error" ? "(no answer)" : `(${outcome})`;
    $("finish").textContent = outcome;
    pollStats();
  }

  function stop() {
    if (running) running.controller.abort();
  }

  function setRunning(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
  }

  function addMessage(role) {
    const li = document.createElement("li");
    li.className = role;
    const label = document.createElement("span");
    label.className = "role";
    label.textContent = role;
    const reasoning = document.createElement("span");
    reasoning.className = "reasoning";
    const body = document.createElement("span");
    body.className = "content";
    const calls = document.createElement("div");
    li.append(label, reasoning, body, calls);
    $("transcript").append(li);
    return { li, reasoning, body, calls };
  }

  // A chunk's delta -> the reply; -> the content it adds.
  function addDelta(reply, delta) {
    if (delta.reasoning_content) reply.reasoning.textContent += delta.reasoning_content;
    for (const call of delta.tool_calls || []) {
      const line = document.createElement("div");
      line.className = "tool-call";
      line.textContent = `tool call: ${call.function.name}(${call.function.arguments})`;
      reply.calls.append(line);
    }
    if (!delta.content) return "";
    if (reply.body.classList.contains("pending")) {
      reply.body.classList.remove("pending");
      reply.body.textContent = "";
    }
    reply.body.textContent += delta.content;
    return delta.content;
  }

  // ---- canvases --------------------------------------------------------------------------------------
  // A draft: the argmax canvas after a step that did not finish it, with each position's entropy and
  // whether the step accepted it. `denoising_steps` counts the request's steps, over all its canvases.
  function onDraft(choice) {
    toCanvas(choice.canvas);
    run.lastSteps = choice.denoising_steps;
    const ids = choice.token_ids;
    const tokens = choice.tokens || ids.map((id) => tokenText.get(id) ?? `#${id}`);
    ids.forEach((id, i) => tokenText.set(id, tokens[i]));
    const prev = run.history[run.history.length - 1];
    const states = ids.map((id, i) => {
      const same = prev !== undefined && prev.ids[i] === id && prev.states[i] !== "renoised";
      if (choice.accepted && !choice.accepted[i]) return "renoised";
      return same ? "settled" : "accepted";
    });
    addFrame({ canvas: choice.canvas, step: choice.denoising_steps - run.base, ids, tokens, states,
               entropy: choice.entropy || null, text: choice.text });
  }

  // A committed canvas: the tokens the chunk carries (cut after the end of the output); its last step
  // is the one after its last draft.
  async function onCommit(ids) {
    const index = run.committed;
    const hadDrafts = run.canvas === index;
    toCanvas(index);
    const steps = (hadDrafts ? run.lastSteps : run.base) + 1 - run.base;
    const last = run.history[run.history.length - 1];
    await learnTokens(ids);
    const tokens = ids.map((id) => tokenText.get(id) ?? `#${id}`);
    const states = ids.map(() => "committed");
    // Positions after the end of the output are dropped; the last draft shows what was there.
    const length = card ? card.canvas_length : ids.length;
    const allIds = [...ids];
    for (let i = ids.length; i < length; i++) {
      allIds.push(last ? last.ids[i] : -1);
      tokens.push(last ? last.tokens[i] : "");
      states.push("dropped");
    }
    addFrame({ canvas: index, step: steps, ids: allIds, tokens, states, entropy: null, text: null });
    run.committed += 1;
    run.base += steps;
  }

  function toCanvas(index) {
    if (run.canvas !== index) {
      run.canvas = index;
      run.history = [];
    }
  }

  // The text of committed tokens that no draft showed (a canvas that ran out of steps can change in
  // its last one), from /detokenize, one id at a time: each token's own text.
  async function learnTokens(ids) {
    const unknown = [...new Set(ids.filter((id) => !tokenText.has(id)))];
    await Promise.all(unknown.map(async (id) => {
      try {
        const r = await api("/detokenize", { method: "POST", headers: { "Content-Type": "application/json" },
                                             body: JSON.stringify({ tokens: [id] }) });
        tokenText.set(id, (await r.json()).prompt);
      } catch (_) { /* shown as #id */ }
    }));
  }

  function addFrame(frame) {
    run.history.push(frame);
    const replay = $("replay");
    replay.max = String(run.history.length - 1);
    replay.value = replay.max;
    replay.disabled = run.history.length < 2;
    showFrame(frame);
  }

  function showFrame(frame) {
    renderGrid(frame);
    const committed = frame.states[0] === "committed";
    $("canvas-index").textContent = `canvas ${frame.canvas + 1}${committed ? " (committed)" : ""}`;
    $("step-count").textContent = String(frame.step);
    $("step-max").textContent = run.maxSteps ? ` / ${run.maxSteps}` : "";
    $("canvas-text").textContent = describe(frame);
  }

  function shown(token) {
    if (token === "") return "∅";
    return token.replace(/ /g, "␣").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
  }

  function renderGrid(frame) {
    const grid = $("grid");
    while (grid.children.length > frame.ids.length) grid.lastChild.remove();
    while (grid.children.length < frame.ids.length) {
      const cell = document.createElement("span");
      cell.className = "cell";
      grid.append(cell);
    }
    frame.ids.forEach((id, i) => {
      const cell = grid.children[i];
      const token = frame.tokens[i];
      const state = frame.states[i];
      const entropy = frame.entropy ? frame.entropy[i] : null;
      cell.textContent = shown(token);
      cell.dataset.state = state;
      cell.classList.toggle("special", token.length > 2 && token.startsWith("<") && token.endsWith(">"));
      // exp(-entropy): 1 for a certain position, towards 0 as the distribution flattens.
      cell.style.setProperty("--conf", entropy === null ? "1" : Math.exp(-entropy).toFixed(3));
      if (entropy === null) delete cell.dataset.entropy;
      else cell.dataset.entropy = entropy.toFixed(4);
      cell.title = `position ${i + 1}: ${JSON.stringify(token)}, ${STATE_WORDS[state]}` +
                   (entropy === null ? "" : `, entropy ${entropy.toFixed(3)} nats`);
    });
  }

  // The accessible text view of a frame: a summary line, the draft's text, and every position with
  // its state mark.
  function describe(frame) {
    const count = (state) => frame.states.filter((s) => s === state).length;
    const n = frame.states.length;
    let summary;
    if (frame.states[0] === "committed") {
      summary = `canvas ${frame.canvas + 1}, committed after ${frame.step} step${frame.step === 1 ? "" : "s"}: ` +
                `${count("committed")} tokens kept` + (count("dropped") ? `, ${count("dropped")} dropped after the end` : "");
    } else {
      const accepted = count("accepted") + count("settled");
      summary = `canvas ${frame.canvas + 1}, step ${frame.step}${run.maxSteps ? ` of ${run.maxSteps}` : ""}: ` +
                `${accepted} of ${n} positions accepted (${count("accepted")} new, ${count("settled")} settled), ` +
                `${count("renoised")} renoised`;
      if (frame.entropy) {
        const mean = frame.entropy.reduce((a, b) => a + b, 0) / n;
        summary += `; mean entropy ${mean.toFixed(3)} nats`;
      }
    }
    const cells = frame.tokens.map((t, i) => `${shown(t)}${STATE_MARKS[frame.states[i]]}`).join(" ");
    const lines = [summary];
    if (frame.text !== null && frame.text !== undefined) lines.push(`text: ${frame.text}`);
    lines.push(`cells: ${cells}`, "(marks: + accepted this step, = settled, ~ renoised, x dropped)");
    return lines.join("\n");
  }

  // ---- the server panel (/metrics) -------------------------------------------------------------------
  let statsTimer = null;
  const samples = []; // [seconds, generated tokens] of recent scrapes

  async function pollStats() {
    clearTimeout(statsTimer);
    statsTimer = null;
    if (document.hidden) return; // resumed on visibilitychange
    try {
      const m = parseMetrics(await (await api("/metrics")).text());
      showStats(m);
      $("stats-note").textContent = "from /metrics, every 2 s";
    } catch (e) {
      $("stats-note").textContent = `/metrics: ${explain(e)}`;
      if (e.status === 401) return; // until a key is given
    }
    statsTimer = setTimeout(pollStats, 2000);
  }

  function parseMetrics(text) {
    const m = new Map();
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const at = line.lastIndexOf(" ");
      m.set(line.slice(0, at), Number(line.slice(at + 1)));
    }
    return m;
  }

  // A family's samples added up: vLLM's families have one per engine (data-parallel replica).
  function total(m, name) {
    let sum = 0;
    let found = false;
    for (const [key, value] of m) {
      if (key === name || key.startsWith(name + "{")) {
        sum += value;
        found = true;
      }
    }
    return found ? sum : undefined;
  }

  function showStats(m) {
    const now = performance.now() / 1000;
    samples.push([now, total(m, "vllm:generation_tokens_total") ?? 0]);
    while (samples.length > 2 && samples[1][0] <= now - 10) samples.shift();
    const [t0, g0] = samples[0];
    const [t1, g1] = samples[samples.length - 1];
    $("stat-tps").textContent = t1 > t0 ? ((g1 - g0) / (t1 - t0)).toFixed(1) : "–";
    const steps = total(m, "vllm:diffusion_num_denoising_steps_total");
    const canvases = total(m, "blockdiff:canvases_total");
    $("stat-spc").textContent = canvases ? (steps / canvases).toFixed(1) : "–";
    const count = total(m, "blockdiff:step_duration_seconds_count");
    $("stat-step").textContent = count ? `${((total(m, "blockdiff:step_duration_seconds_sum") / count) * 1000).toFixed(1)} ms` : "–";
    $("stat-running").textContent = String(total(m, "vllm:num_requests_running") ?? "–");
    $("stat-waiting").textContent = String(total(m, "vllm:num_requests_waiting") ?? "–");
    // The engines' mean: replicas have caches of one size.
    const engines = [...m.keys()].filter((key) => key.startsWith("vllm:kv_cache_usage_perc{")).length;
    const kv = engines ? total(m, "vllm:kv_cache_usage_perc") / engines : 0;
    $("stat-kv-meter").value = kv;
    $("stat-kv").textContent = `${(kv * 100).toFixed(1)} %`;
  }

  // ---- wiring --------------------------------------------------------------------------------------
  function newChat() {
    if (running) return;
    conversation = [];
    run = null;
    $("transcript").replaceChildren();
    $("grid").replaceChildren();
    $("canvas-index").textContent = "no canvas yet";
    $("step-count").textContent = "0";
    $("step-max").textContent = "";
    $("finish").textContent = "";
    $("canvas-text").textContent = "No canvas yet.";
    $("replay").max = "0";
    $("replay").disabled = true;
    $("prompt").focus();
  }

  function start() {
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      send();
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape") stop();
    });
    $("stop").addEventListener("click", stop);
    $("clear").addEventListener("click", newChat);
    $("defaults").addEventListener("click", () => fillDefaults(true));
    control("temperature").addEventListener("input", showSchedule);
    $("replay").addEventListener("input", () => {
      if (run && run.history.length) showFrame(run.history[Number($("replay").value)]);
    });
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORAGE, key);
      $("key-message").textContent = "checking the key…";
      connect();
    });
    $("key-button").hidden = !keyRequired;
    $("key-button").addEventListener("click", () => askKey(""));
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && card && statsTimer === null) pollStats();
    });

    const query = new URLSearchParams(location.search);
    if (query.has("prompt")) $("prompt").value = query.get("prompt");
    for (const name of FIELDS) {
      if (query.has(name)) {
        control(name).value = query.get(name);
        userSet.add(name);
      }
    }
    autorun = query.get("autorun") === "1" && query.has("prompt");
    if (keyRequired && !apiKey()) {
      $("model").textContent = "waiting for the API key";
      askKey("");
      return;
    }
    $("prompt").focus();
    connect();
  }

  start();
})();

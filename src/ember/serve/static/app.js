// Ember's chat page: multi-turn chat against the server's OpenAI-compatible /v1/chat/completions.
// Answers stream over SSE (read with fetch + a stream reader, since EventSource cannot POST) and are
// re-rendered as Markdown on each animation frame. Stop aborts the fetch: the server sees the connection
// close, cancels the request and frees its KV blocks. Settings, the API key included, live in localStorage.
// Each answer shows time to first token (from sending to the first content) and the decode rate in tokens/s.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const STORE = "ember.settings";
  const DEFAULTS = { system: "", temperature: 0.7, top_p: 0.9, max_tokens: 512, api_key: "", model: "" };

  const settings = { ...DEFAULTS, ...loadSettings() };
  const history = []; // {role, content} of finished turns, sent with each request
  let controller = null; // the AbortController of the answer being streamed, if any

  function loadSettings() {
    try {
      return JSON.parse(localStorage.getItem(STORE) || "{}");
    } catch (e) {
      console.warn("ember: ignoring unreadable settings", e);
      return {};
    }
  }

  function saveSettings() {
    localStorage.setItem(STORE, JSON.stringify(settings));
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (settings.api_key) h.Authorization = `Bearer ${settings.api_key}`;
    return h;
  }

  // ---- settings panel -------------------------------------------------------------------------------

  function bindSettings() {
    const fields = [
      ["system", "system", String],
      ["temperature", "temperature", Number],
      ["top-p", "top_p", Number],
      ["max-tokens", "max_tokens", (v) => Math.max(1, parseInt(v, 10) || DEFAULTS.max_tokens)],
      ["api-key", "api_key", (v) => v.trim()],
    ];
    for (const [id, key, parse] of fields) {
      const el = $(id);
      el.value = settings[key];
      el.addEventListener("input", () => {
        settings[key] = parse(el.value);
        saveSettings();
        showSliderValues();
        if (key === "api_key") loadModels();
      });
    }
    showSliderValues();
    $("toggle-settings").addEventListener("click", () => toggleSettings());
    $("settings").addEventListener("submit", (ev) => ev.preventDefault());
  }

  function toggleSettings(open) {
    const panel = $("settings");
    const show = open === undefined ? panel.hidden : open;
    panel.hidden = !show;
    $("toggle-settings").setAttribute("aria-expanded", String(show));
  }

  function showSliderValues() {
    $("temperature-value").textContent = Number(settings.temperature).toFixed(2);
    $("top-p-value").textContent = Number(settings.top_p).toFixed(2);
  }

  // ---- models -------------------------------------------------------------------------------------------

  async function loadModels() {
    const select = $("model");
    let resp;
    try {
      resp = await fetch("/v1/models", { headers: headers() });
    } catch (e) {
      select.innerHTML = '<option value="">server unreachable</option>';
      return;
    }
    if (!resp.ok) {
      select.innerHTML = `<option value="">${resp.status === 401 ? "API key needed" : "unavailable"}</option>`;
      if (resp.status === 401) askForKey(await errorMessage(resp));
      return;
    }
    clearNotice();
    const ids = ((await resp.json()).data || []).map((m) => m.id);
    select.innerHTML = ids.map((id) => `<option>${window.escapeHtml(id)}</option>`).join("");
    if (ids.includes(settings.model)) select.value = settings.model;
    settings.model = select.value;
    document.title = select.value ? `Ember chat — ${select.value}` : "Ember chat";
  }

  // ---- messages -----------------------------------------------------------------------------------------

  function addMessage(role, text) {
    $("empty").hidden = true;
    const el = document.createElement("div");
    el.className = `message ${role}`;
    el.dataset.role = role;
    el.innerHTML = '<div class="body"></div><div class="meta"></div>';
    setBody(el, role, text);
    $("messages").appendChild(el);
    scrollToEnd();
    return el;
  }

  function setBody(el, role, text) {
    const body = el.querySelector(".body");
    if (role === "assistant") body.innerHTML = window.renderMarkdown(text);
    else body.textContent = text;
  }

  function scrollToEnd() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  let noticeEl = null;
  function showNotice(text, kind) {
    clearNotice();
    noticeEl = document.createElement("div");
    noticeEl.className = `notice ${kind}`;
    noticeEl.dataset.testid = "notice";
    noticeEl.textContent = text;
    $("messages").appendChild(noticeEl);
    scrollToEnd();
  }

  function clearNotice() {
    if (noticeEl) noticeEl.remove();
    noticeEl = null;
  }

  // The OpenAI error body is {"error": {"message": ...}}; FastAPI's own errors are {"detail": ...}.
  async function errorMessage(resp) {
    let message = `${resp.status} ${resp.statusText}`;
    try {
      const body = await resp.json();
      if (body.error && body.error.message) message = body.error.message;
      else if (typeof body.detail === "string") message = body.detail;
      else if (body.detail) message = JSON.stringify(body.detail);
    } catch (e) {
      // Not JSON (a proxy's page, say): the status line is all there is to show.
    }
    if (resp.status === 401) {
      return `The server needs an API key (${message}). Enter it under Settings → API key.`;
    }
    return `Server error ${resp.status}: ${message}`;
  }

  class ServerError extends Error {}
  class AuthError extends ServerError {}

  function askForKey(message) {
    showNotice(message, "error");
    toggleSettings(true);
    $("api-key").focus();
  }

  // ---- streaming one answer ----------------------------------------------------------------------------

  // Yields the parsed JSON of each `data:` event of an SSE response, until `data: [DONE]`.
  async function* sseEvents(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = event
          .split(/\r?\n/)
          .filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  function formatStats(s) {
    if (s.ttft === null) return s.finish || "waiting for the first token…";
    const parts = [`TTFT ${(s.ttft / 1000).toFixed(2)} s`];
    parts.push(`${s.tokens} tokens`);
    if (s.rate !== null) parts.push(`${s.rate.toFixed(1)} tok/s`);
    if (s.finish) parts.push(s.finish);
    return parts.join(" · ");
  }

  async function send(text) {
    clearNotice();
    const messages = [];
    if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
    messages.push(...history, { role: "user", content: text });
    const asked = addMessage("user", text);
    const el = addMessage("assistant", "");
    el.classList.add("streaming");
    const meta = el.querySelector(".meta");
    meta.dataset.testid = "stats";

    controller = new AbortController();
    setBusy(true);
    const started = performance.now();
    const stats = { ttft: null, tokens: 0, rate: null, finish: "" };
    let answer = "";
    let firstAt = null;
    let usageTokens = null;
    let frame = 0;
    const paint = () => {
      frame = 0;
      setBody(el, "assistant", answer);
      if (firstAt !== null) {
        const elapsed = (performance.now() - firstAt) / 1000;
        // The first token's time is TTFT; the rate counts the tokens decoded after it.
        stats.rate = stats.tokens > 1 && elapsed > 0 ? (stats.tokens - 1) / elapsed : null;
      }
      meta.textContent = formatStats(stats);
      scrollToEnd();
    };

    let ok = false;
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers(),
        signal: controller.signal,
        body: JSON.stringify({
          model: settings.model || undefined,
          messages,
          stream: true,
          stream_options: { include_usage: true },
          temperature: settings.temperature,
          top_p: settings.top_p,
          max_tokens: settings.max_tokens,
        }),
      });
      if (resp.status === 401) throw new AuthError(await errorMessage(resp));
      if (!resp.ok) throw new ServerError(await errorMessage(resp));
      for await (const chunk of sseEvents(resp)) {
        if (chunk.error) throw new ServerError(`Server error: ${chunk.error.message || JSON.stringify(chunk.error)}`);
        if (chunk.usage) usageTokens = chunk.usage.completion_tokens;
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece) {
          if (firstAt === null) {
            firstAt = performance.now();
            stats.ttft = firstAt - started;
          }
          answer += piece;
          stats.tokens += 1; // one content chunk per token, until the usage chunk gives the exact count
        }
        if (choice.finish_reason) stats.finish = choice.finish_reason === "length" ? "hit max tokens" : "";
        if (!frame) frame = requestAnimationFrame(paint);
      }
      ok = true;
    } catch (e) {
      if (e.name === "AbortError") {
        stats.finish = "stopped";
        ok = answer.length > 0;
      } else {
        if (e instanceof AuthError) askForKey(e.message);
        else if (e instanceof ServerError) showNotice(e.message, "error");
        // fetch() itself failed: the server is down or the connection dropped mid-answer.
        else showNotice(`Request failed: ${e.message}`, "error");
      }
    } finally {
      if (frame) cancelAnimationFrame(frame);
      if (usageTokens !== null) stats.tokens = usageTokens;
      paint();
      el.classList.remove("streaming");
      controller = null;
      setBusy(false);
    }
    if (ok) {
      history.push({ role: "user", content: text }, { role: "assistant", content: answer });
      el.dataset.done = stats.finish || "stop";
    } else {
      // A failed turn is not part of the conversation: the next question is sent without it. Its text goes
      // back into the empty prompt box, to be edited and sent again.
      el.remove();
      asked.classList.add("failed");
      asked.title = "not sent to the model; it is not part of the conversation";
      if (!$("prompt").value) $("prompt").value = text;
    }
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.classList.toggle("busy", busy);
  }

  function stop() {
    if (controller) controller.abort();
  }

  function newChat() {
    stop();
    history.length = 0;
    clearNotice();
    for (const el of [...$("messages").querySelectorAll(".message")]) el.remove();
    $("empty").hidden = false;
    $("prompt").focus();
  }

  // ---- wiring -------------------------------------------------------------------------------------------

  function init() {
    bindSettings();
    $("model").addEventListener("change", () => {
      settings.model = $("model").value;
      saveSettings();
    });
    $("composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const prompt = $("prompt");
      const text = prompt.value.trim();
      if (!text || controller) return;
      prompt.value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", newChat);
    loadModels();
  }

  init();
})();

// The chat page of `deepinfer serve`: plain JavaScript over the server's own OpenAI endpoints
// (/v1/models, /v1/chat/completions streamed as server-sent events). Text is always set as
// text, never as HTML, so nothing a model writes can run in the page.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["temperature", "top_p", "max_tokens", "seed", "thinking", "system", "tools", "tool_choice", "api_key"];
const conversation = []; // the messages so far, as the API takes them
let controller = null; // the running request's AbortController
let chatNumber = 0; // New chat moves it on: a reply that ends later belongs to the old chat

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function saveSettings() {
  for (const id of SETTINGS) localStorage.setItem(`deepinfer.${id}`, $(id).value);
}

function loadSettings() {
  for (const id of SETTINGS) {
    const value = localStorage.getItem(`deepinfer.${id}`);
    if (value !== null) $(id).value = value;
  }
}

async function loadModels() {
  const select = $("model");
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    select.replaceChildren(...body.data.map((m) => new Option(m.parent ? `${m.id} (adapter)` : m.id, m.id)));
  } catch (err) {
    showError(`Could not list the models: ${err.message}`);
  }
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function addMessage(role, text) {
  const box = element("div", `message ${role}`);
  box.dataset.role = role;
  const content = element("div", "content", text || "");
  box.append(content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function showError(text) {
  const box = addMessage("assistant", "");
  box.querySelector(".content").replaceWith(element("div", "content error", text));
}

// One assistant reply as it streams: folded reasoning, content, tool calls, speed.
class Reply {
  constructor() {
    this.box = addMessage("assistant", "");
    this.content = this.box.querySelector(".content");
    this.reasoning = null;
    this.calls = [];
    this.text = "";
    this.thought = "";
    this.start = performance.now();
    this.first = null;
    this.pieces = 0;
    this.stats = element("div", "stats");
    this.box.append(this.stats);
  }

  addReasoning(text) {
    if (!this.reasoning) {
      const details = element("details", "reasoning"); // folded until the reader opens it
      details.append(element("summary", "", "Reasoning"), element("pre"));
      this.box.insertBefore(details, this.content);
      this.reasoning = details.querySelector("pre");
    }
    this.thought += text;
    this.reasoning.textContent = this.thought;
  }

  addContent(text) {
    this.text += text;
    this.content.textContent = this.text;
  }

  addToolCalls(parts) {
    for (const part of parts) {
      let call = this.calls[part.index];
      if (!call) {
        call = this.calls[part.index] = { id: part.id, name: "", arguments: "", el: element("div", "tool-call") };
        this.box.insertBefore(call.el, this.stats);
      }
      const fn = part.function || {};
      call.name += fn.name || "";
      call.arguments += fn.arguments || "";
      call.el.textContent = `tool call: ${call.name}(${call.arguments})`;
    }
  }

  tick(tokens) {
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.pieces += 1;
    const count = tokens ?? this.pieces;
    const seconds = (now - this.first) / 1000;
    const rate = seconds > 0 ? (count / seconds).toFixed(1) : "-";
    const ttft = ((this.first - this.start) / 1000).toFixed(2);
    this.stats.textContent = `${count} tokens · ${rate} tokens/s · first token ${ttft} s`;
  }

  showError(text) {
    this.box.insertBefore(element("div", "content error", text), this.stats);
  }

  finish(note) {
    if (note) this.stats.textContent += ` · ${note}`;
    if (!this.text && !this.calls.some(Boolean)) return null; // nothing to send back
    const message = { role: "assistant", content: this.text || null };
    const calls = this.calls.filter(Boolean);
    if (calls.length) {
      message.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
    }
    return message;
  }
}

function requestBody() {
  const body = {
    model: $("model").value,
    messages: [],
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("thinking").value) body.chat_template_kwargs = { thinking: $("thinking").value === "on" };
  if ($("system").value.trim()) body.messages.push({ role: "system", content: $("system").value });
  body.messages.push(...conversation);
  const tools = $("tools").value.trim();
  if (tools) {
    body.tools = JSON.parse(tools); // a SyntaxError is shown to the user
    body.tool_choice = $("tool_choice").value;
  }
  return body;
}

async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function busy(running) {
  $("send").disabled = running;
  $("stop").disabled = !running;
}

async function send(text) {
  const chat = chatNumber;
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  let body;
  try {
    body = requestBody();
  } catch (err) {
    conversation.pop();
    showError(`Tools: ${err.message}`);
    return;
  }
  saveSettings();
  const reply = new Reply();
  controller = new AbortController();
  busy(true);
  let note = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : `${r.status} ${r.statusText}`);
    }
    for await (const chunk of events(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (choice) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) reply.addReasoning(delta.reasoning_content);
        if (delta.content) reply.addContent(delta.content);
        if (delta.tool_calls) reply.addToolCalls(delta.tool_calls);
        if (delta.reasoning_content || delta.content || delta.tool_calls) reply.tick();
        if (choice.finish_reason) note = `finish: ${choice.finish_reason}`;
      }
      if (chunk.usage) reply.tick(chunk.usage.completion_tokens);
      reply.box.scrollIntoView({ block: "end" });
    }
  } catch (err) {
    if (err.name === "AbortError") {
      note = "stopped";
    } else {
      reply.showError(err.message); // shown, never sent back to the model as its words
      note = "error";
    }
  } finally {
    controller = null;
    busy(false);
  }
  const message = reply.finish(note);
  if (chat !== chatNumber) return;
  if (message) {
    conversation.push(message);
  } else {
    conversation.pop(); // a turn with no reply is not resent: the next message stands alone
  }
}

function init() {
  loadSettings();
  loadModels();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    chatNumber += 1;
    conversation.length = 0;
    $("messages").replaceChildren();
  });
  $("toggle-settings").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
  });
  $("api_key").addEventListener("change", () => {
    saveSettings();
    loadModels();
  });
}

init();

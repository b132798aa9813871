// The chat page of a krafla server (served at / by krafla_twisted/api/page.py).
//
// It calls the server's own OpenAI API, relative to the page (so it works behind a proxy's path
// prefix too): GET v1/models for the model picker, POST v1/chat/completions with "stream": true,
// read with fetch's stream reader as server-sent events. Stop aborts the fetch; the server sees
// the connection close and cancels the generation. Conversations, settings and the API key are
// kept in this browser's localStorage. When the server has --api-key, a 401 opens the key dialog;
// the key is then sent as "Authorization: Bearer KEY" and kept for the next visit.

import { renderMarkdown } from "./markdown.js";

const STORAGE = {
  conversations: "krafla.conversations",
  current: "krafla.current",
  settings: "krafla.settings",
  key: "krafla.apiKey",
};
const DEFAULT_SETTINGS = { model: "", system: "", temperature: "", top_p: "", max_tokens: "", seed: "" };
const TITLE_LENGTH = 48;

const $ = (id) => document.getElementById(id);

// --- storage ---

function readStored(name, fallback) {
  try {
    const text = localStorage.getItem(name);
    return text === null ? fallback : JSON.parse(text);
  } catch (error) {
    console.warn("krafla: ignoring unreadable localStorage entry", name, error);
    return fallback;
  }
}

function writeStored(name, value) {
  try {
    localStorage.setItem(name, JSON.stringify(value));
  } catch (error) {
    showStatus("Could not save in this browser's storage: " + error.message, true);
  }
}

const state = {
  conversations: readStored(STORAGE.conversations, []).filter((c) => c && Array.isArray(c.messages)),
  currentId: readStored(STORAGE.current, null),
  settings: { ...DEFAULT_SETTINGS, ...readStored(STORAGE.settings, {}) },
  models: [],
  streaming: null, // {controller, conversation, message, element}
};

function saveConversations() {
  writeStored(STORAGE.conversations, state.conversations);
  writeStored(STORAGE.current, state.currentId);
}

function saveSettings() {
  writeStored(STORAGE.settings, state.settings);
}

function currentConversation() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function newId() {
  if (crypto.randomUUID) return crypto.randomUUID();
  return Date.now().toString(36) + Math.random().toString(36).slice(2);
}

// --- the API key ---

function apiKey() {
  return localStorage.getItem(STORAGE.key) || "";
}

let keyRequest = null; // the open dialog's promise, shared by every caller that got a 401

// Show the key dialog; resolves true once a key is stored, false if the user cancels.
function askForKey(message) {
  if (keyRequest) return keyRequest;
  keyRequest = new Promise((resolve) => {
    $("key-message").textContent = message;
    $("key-input").value = "";
    $("key-dialog").hidden = false;
    $("key-input").focus();
    const finish = (stored) => {
      $("key-dialog").hidden = true;
      $("key-form").removeEventListener("submit", onSubmit);
      $("key-cancel").removeEventListener("click", onCancel);
      keyRequest = null;
      updateKeyButton();
      resolve(stored);
    };
    const onSubmit = (event) => {
      event.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      localStorage.setItem(STORAGE.key, key);
      finish(true);
    };
    const onCancel = () => finish(false);
    $("key-form").addEventListener("submit", onSubmit);
    $("key-cancel").addEventListener("click", onCancel);
  });
  return keyRequest;
}

function updateKeyButton() {
  $("forget-key").hidden = !apiKey();
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error) return typeof body.error === "string" ? body.error : body.error.message || text;
  } catch (error) {
    // not JSON: the text itself
  }
  return text || `${response.status} ${response.statusText}`;
}

// fetch() on the server's API with the stored key; a 401 asks for the key and tries again.
async function apiFetch(path, init = {}) {
  for (;;) {
    const headers = { ...(init.headers || {}) };
    const key = apiKey();
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    const reason = await errorMessage(response);
    const message = key ? `The server refused the key (${reason}). Enter the right one.` : "This server needs an API key.";
    if (!(await askForKey(message))) {
      throw new Error("This server needs an API key: " + reason);
    }
  }
}

// --- server-sent events ---

// The `data:` payloads of an event stream, as they arrive.
async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

// --- the model picker ---

async function loadModels() {
  showStatus("connecting…");
  let response;
  try {
    response = await apiFetch("v1/models");
  } catch (error) {
    showStatus(error.message, true);
    return;
  }
  if (!response.ok) {
    showStatus("v1/models: " + (await errorMessage(response)), true);
    return;
  }
  const body = await response.json();
  state.models = (body.data || []).map((model) => model.id);
  const select = $("model");
  select.replaceChildren(...state.models.map((id) => {
    const option = document.createElement("option");
    option.value = id;
    option.textContent = id;
    return option;
  }));
  if (!state.models.includes(state.settings.model)) {
    state.settings.model = state.models[0] || "";
    saveSettings();
  }
  select.value = state.settings.model;
  showStatus(state.models.length === 1 ? "1 model" : `${state.models.length} models`);
}

function showStatus(text, isError = false) {
  const status = $("server-status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

// --- settings ---

const SETTING_INPUTS = { system: "system", temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed" };

function showSettings() {
  for (const [name, id] of Object.entries(SETTING_INPUTS)) $(id).value = state.settings[name];
}

// The request fields the settings set (an empty field is left to the server's default).
function samplingFields() {
  const fields = {};
  for (const name of ["temperature", "top_p"]) {
    if (state.settings[name] !== "") fields[name] = Number(state.settings[name]);
  }
  for (const name of ["max_tokens", "seed"]) {
    if (state.settings[name] !== "") fields[name] = parseInt(state.settings[name], 10);
  }
  return fields;
}

// --- conversations ---

function titleOf(conversation) {
  const first = conversation.messages.find((m) => m.role === "user");
  if (!first) return "New chat";
  const line = first.content.trim().split("\n")[0];
  return line.length > TITLE_LENGTH ? line.slice(0, TITLE_LENGTH - 1) + "…" : line;
}

function renderConversationList() {
  const items = [...state.conversations].sort((a, b) => b.updated - a.updated).map((conversation) => {
    const item = document.createElement("li");
    item.dataset.id = conversation.id;
    item.classList.toggle("current", conversation.id === state.currentId);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open-chat";
    open.textContent = titleOf(conversation);
    open.title = titleOf(conversation);
    open.addEventListener("click", () => selectConversation(conversation.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete-chat";
    remove.textContent = "×";
    remove.title = "Delete this chat";
    remove.setAttribute("aria-label", "Delete " + titleOf(conversation));
    remove.addEventListener("click", () => deleteConversation(conversation.id));
    item.append(open, remove);
    return item;
  });
  $("conversations").replaceChildren(...items);
}

function selectConversation(id) {
  state.currentId = id;
  saveConversations();
  renderConversationList();
  renderMessages();
}

function newConversation() {
  const conversation = { id: newId(), messages: [], created: Date.now(), updated: Date.now() };
  state.conversations.push(conversation);
  return conversation;
}

function deleteConversation(id) {
  if (state.streaming && state.streaming.conversation.id === id) state.streaming.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = null;
  saveConversations();
  renderConversationList();
  renderMessages();
}

// --- messages ---

function formatStats(message) {
  const stats = message.stats;
  if (!stats) return "";
  const parts = [];
  if (message.model) parts.push(message.model);
  const counted = stats.counted ? " (counted)" : "";
  parts.push(`${stats.tokens} token${stats.tokens === 1 ? "" : "s"}${counted}`);
  if (stats.tokens_per_second !== null) parts.push(`${stats.tokens_per_second.toFixed(1)} tokens/s`);
  if (stats.first_token_seconds !== null) parts.push(`first token ${stats.first_token_seconds.toFixed(2)} s`);
  return parts.join(" · ");
}

function fillMessage(element, message) {
  element.dataset.state = message.state || "done";
  const body = element.querySelector(".content");
  if (message.role === "assistant") {
    const nodes = [];
    if (message.reasoning) {
      const details = document.createElement("details");
      details.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      details.append(summary, renderMarkdown(message.reasoning));
      details.open = element.querySelector("details.reasoning")?.open || false;
      nodes.push(details);
    }
    nodes.push(renderMarkdown(message.content));
    body.replaceChildren(...nodes);
  } else {
    body.textContent = message.content;
  }
  const notes = [];
  if (message.state === "stopped") notes.push("stopped");
  if (message.error) notes.push(message.error);
  const stats = formatStats(message);
  if (stats) notes.push(stats);
  const meta = element.querySelector(".meta");
  meta.textContent = notes.join(" · ");
  meta.classList.toggle("error", Boolean(message.error));
}

function messageElement(message) {
  const element = document.createElement("div");
  element.className = "message " + message.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  element.append(role, content, meta);
  fillMessage(element, message);
  return element;
}

function renderMessages() {
  const conversation = currentConversation();
  const container = $("messages");
  if (!conversation || conversation.messages.length === 0) {
    const empty = document.createElement("div");
    empty.className = "empty";
    empty.textContent = "Send a message to start.";
    container.replaceChildren(empty);
    return;
  }
  container.replaceChildren(...conversation.messages.map((message) => {
    const element = messageElement(message);
    if (state.streaming && state.streaming.message === message) state.streaming.element = element;
    return element;
  }));
  container.scrollTop = container.scrollHeight;
}

function nearBottom(container) {
  return container.scrollHeight - container.scrollTop - container.clientHeight < 80;
}

// --- sending ---

// The messages a request carries: the system prompt, then the conversation's turns (replies
// that failed, or are still empty, are left out).
function requestMessages(conversation, pending) {
  const messages = [];
  if (state.settings.system.trim()) messages.push({ role: "system", content: state.settings.system });
  for (const message of conversation.messages) {
    if (message === pending || message.error || (message.role === "assistant" && !message.content)) continue;
    messages.push({ role: message.role, content: message.content });
  }
  return messages;
}

function setStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.streaming) return;
  let conversation = currentConversation();
  if (!conversation) {
    conversation = newConversation();
    state.currentId = conversation.id;
  }
  $("prompt").value = "";
  conversation.messages.push({ role: "user", content: text });
  const message = { role: "assistant", content: "", model: state.settings.model, state: "streaming" };
  conversation.messages.push(message);
  conversation.updated = Date.now();
  saveConversations();
  renderConversationList();

  const controller = new AbortController();
  state.streaming = { controller, conversation, message, element: null };
  renderMessages();
  setStreaming(true);

  const started = performance.now();
  let firstToken = null;
  let chunks = 0;
  let usage = null;
  let redraw = 0;
  const draw = () => {
    redraw = 0;
    const element = state.streaming && state.streaming.element;
    if (!element || !element.isConnected) return;
    const container = $("messages");
    const follow = nearBottom(container);
    fillMessage(element, message);
    if (follow) container.scrollTop = container.scrollHeight;
  };
  const body = {
    model: state.settings.model || undefined,
    messages: requestMessages(conversation, message),
    stream: true,
    stream_options: { include_usage: true },
    ...samplingFields(),
  };
  try {
    const response = await apiFetch("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of serverEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      if (chunk.model) message.model = chunk.model;
      const delta = chunk.choices && chunk.choices.length ? chunk.choices[0].delta || {} : {};
      const piece = delta.content || "";
      const thought = delta.reasoning_content || "";
      if (piece || thought) {
        if (firstToken === null) firstToken = performance.now();
        chunks += 1;
        message.content += piece;
        message.reasoning = (message.reasoning || "") + thought;
        if (!redraw) redraw = requestAnimationFrame(draw);
      }
    }
    message.state = "done";
  } catch (error) {
    if (controller.signal.aborted) {
      message.state = "stopped";
    } else {
      message.state = "error";
      message.error = error.message;
    }
  }
  if (redraw) cancelAnimationFrame(redraw);
  const ended = performance.now();
  const tokens = usage ? usage.completion_tokens : chunks;
  // Tokens after the first, over the time after the first: the generation's speed, without the prompt's.
  const generating = firstToken === null ? 0 : (ended - firstToken) / 1000;
  message.stats = {
    tokens,
    counted: !usage,
    tokens_per_second: tokens > 1 && generating > 0 ? (tokens - 1) / generating : null,
    first_token_seconds: firstToken === null ? null : (firstToken - started) / 1000,
  };
  conversation.updated = Date.now();
  const element = state.streaming.element;
  state.streaming = null;
  saveConversations();
  if (element && element.isConnected) fillMessage(element, message);
  setStreaming(false);
  $("prompt").focus();
}

function stop() {
  if (state.streaming) state.streaming.controller.abort();
}

// --- wiring ---

// Copy a code block's text; where the clipboard API is missing (a page not served from localhost
// or HTTPS is no secure context), select the text instead, for Ctrl+C.
function copyCode(button) {
  const code = button.closest(".code-block").querySelector("code");
  const selectText = () => {
    const range = document.createRange();
    range.selectNodeContents(code);
    window.getSelection().removeAllRanges();
    window.getSelection().addRange(range);
    button.textContent = "Selected";
  };
  const done = () => {
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  };
  if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(code.textContent).then(done, selectText);
  else selectText();
}

function start() {
  showSettings();
  updateKeyButton();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    state.currentId = null;
    saveConversations();
    renderConversationList();
    renderMessages();
    $("prompt").focus();
  });
  $("model").addEventListener("change", () => {
    state.settings.model = $("model").value;
    saveSettings();
  });
  for (const [name, id] of Object.entries(SETTING_INPUTS)) {
    $(id).addEventListener("input", () => {
      state.settings[name] = $(id).value;
      saveSettings();
    });
  }
  $("reset-settings").addEventListener("click", () => {
    state.settings = { ...DEFAULT_SETTINGS, model: state.settings.model };
    saveSettings();
    showSettings();
  });
  $("toggle-settings").addEventListener("click", () => {
    const open = $("settings").hidden;
    $("settings").hidden = !open;
    $("toggle-settings").setAttribute("aria-expanded", String(open));
  });
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(STORAGE.key);
    updateKeyButton();
  });
  $("messages").addEventListener("click", (event) => {
    const button = event.target.closest(".copy-code");
    if (button) copyCode(button);
  });
  // Another tab of this page changed the stored chats: show them (unless this tab is streaming).
  window.addEventListener("storage", (event) => {
    if (event.key !== STORAGE.conversations || state.streaming) return;
    state.conversations = readStored(STORAGE.conversations, []);
    renderConversationList();
    renderMessages();
  });
  // A reply cut off by a reload was saved while streaming: it is kept, marked as stopped.
  for (const conversation of state.conversations) {
    for (const message of conversation.messages) {
      if (message.state === "streaming") message.state = "stopped";
    }
  }
  renderConversationList();
  renderMessages();
  loadModels();
  $("prompt").focus();
}

start();

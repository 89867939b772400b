// Rendering the page: the messages (with their figures), the composer's buttons and the
// conversation list.

import { $, el } from "./dom.js";
import { STORE, currentConversation, saveConversations, state } from "./storage.js";
import { renderMarkdown } from "./markdown.js";
import { TRANSPORT_NAMES, updateTransportStatus } from "./transport.js";

const messageNodes = new WeakMap(); // message object -> its <li>, while it is on screen
const dirty = new Set();
let frameRequested = false;

/** Re-renders a message on the next animation frame (streams update many times a frame). */
export function renderMessageSoon(message) {
  dirty.add(message);
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame(() => {
    frameRequested = false;
    // Follow a growing answer, unless the reader scrolled up to read something else.
    const list = $("messages");
    const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
    for (const m of dirty) {
      const node = messageNodes.get(m);
      if (node && node.isConnected) fillMessage(node, m);
    }
    dirty.clear();
    if (atBottom) list.scrollTop = list.scrollHeight;
  });
}

function formatNumber(value, digits) {
  return Number.isFinite(value) ? value.toFixed(digits) : "–";
}

function stat(testid, label, value) {
  const span = el("span", "stat");
  span.dataset.testid = testid;
  span.append(el("span", "stat-label", `${label} `), el("span", "stat-value", value));
  return span;
}

/** Fills a message's <li>: text, error, figures and actions. */
function fillMessage(node, message) {
  node.dataset.state = message.state || "done";
  const content = el("div", "message-content");
  content.dataset.testid = "message-content";
  if (message.role === "assistant") content.append(renderMarkdown(message.content));
  else content.textContent = message.content; // the user's text is shown as typed
  const parts = [content];

  if (message.error) {
    const error = el("div", "message-error", message.error);
    error.dataset.testid = "message-error";
    error.setAttribute("role", "alert");
    parts.push(error);
  }
  if (message.role === "assistant") {
    const s = message.stats || {};
    node.dataset.finishReason = s.finishReason || "";
    node.dataset.transport = s.transport || "";
    const stats = el("div", "message-stats");
    stats.dataset.testid = "message-stats";
    stats.append(
      stat("stat-ttft", "TTFT", s.ttftMs === undefined ? "–" : `${formatNumber(s.ttftMs, 0)} ms`),
      stat("stat-tps", "tok/s", formatNumber(s.tokensPerS, 1)),
      stat("stat-prompt-tokens", "prompt", s.promptTokens ?? "–"),
      stat("stat-completion-tokens", "completion", s.completionTokens ?? "–"),
    );
    if (message.model) stats.append(stat("stat-model", "model", message.model));
    if (s.transport) stats.append(stat("stat-transport", "via", TRANSPORT_NAMES[s.transport]));
    if (message.state === "streaming") stats.append(el("span", "badge streaming", "streaming…"));
    else if (message.state === "stopped") stats.append(el("span", "badge", "stopped"));
    else if (message.state === "interrupted") stats.append(el("span", "badge", "interrupted"));
    else if (s.finishReason === "length") stats.append(el("span", "badge", "max tokens"));
    parts.push(stats);
  }
  node.replaceChildren(...parts);
}

export function renderMessages() {
  const list = $("messages");
  const conv = currentConversation();
  const messages = conv ? conv.messages : [];
  const nodes = messages.map((message, index) => {
    const node = el("li", `message ${message.role}`);
    node.dataset.testid = "message";
    node.dataset.role = message.role;
    node.dataset.index = String(index);
    messageNodes.set(message, node);
    fillMessage(node, message);
    return node;
  });
  list.replaceChildren(...nodes);
  list.lastElementChild?.scrollIntoView({ block: "end" });
}

export function renderComposer() {
  const busy = state.generations.has(state.currentId);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  // Regenerate replaces the last answer; it sits in the composer, where it does not move
  // while an answer grows.
  const last = currentConversation()?.messages.at(-1);
  $("regenerate").hidden = last?.role !== "assistant";
  document.body.dataset.busy = String(busy);
}

export function renderConversationList() {
  const list = $("conversation-list");
  const items = state.conversations.map((conv) => {
    const item = el("li", conv.id === state.currentId ? "active" : "");
    const open = el("button", "open-conversation", conv.title || "New chat");
    open.type = "button";
    open.dataset.testid = "conversation";
    open.setAttribute("aria-current", conv.id === state.currentId ? "true" : "false");
    open.addEventListener("click", () => selectConversation(conv.id));
    const remove = el("button", "delete-conversation", "×");
    remove.type = "button";
    remove.title = "Delete conversation";
    remove.setAttribute("aria-label", `Delete ${conv.title || "conversation"}`);
    remove.addEventListener("click", () => deleteConversation(conv.id));
    item.append(open, remove);
    return item;
  });
  list.replaceChildren(...items);
}

function selectConversation(id) {
  state.currentId = id;
  localStorage.setItem(STORE.current, id);
  renderAll();
  closeSidebarOnPhone();
  $("prompt").focus();
}

function deleteConversation(id) {
  state.generations.get(id)?.stop();
  state.generations.delete(id);
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = state.conversations[0]?.id ?? null;
  saveConversations();
  if (!state.currentId) localStorage.removeItem(STORE.current);
  renderAll();
}

export function renderAll() {
  renderConversationList();
  renderMessages();
  renderComposer();
  updateTransportStatus();
}

export function closeSidebarOnPhone() {
  if (window.matchMedia("(max-width: 700px)").matches) {
    document.body.classList.remove("sidebar-open");
    $("toggle-sidebar").setAttribute("aria-expanded", "false");
  }
}

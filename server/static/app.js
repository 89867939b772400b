// kvserve's built-in chat page: plain JavaScript, no build step, nothing from a CDN.
//
// Answers stream over one multiplexed WebSocket (/v1/ws: each request carries an id, a cancel
// names that id) and fall back to SSE (POST /v1/chat/completions with stream: true) when the
// socket cannot be opened. Model text never becomes markup: the Markdown renderer builds DOM
// nodes and puts every piece of text in through textContent, so there is no innerHTML here.
//
// This file wires the page up: the model picker, the settings panel, the composer, and the
// start. The rest, one concern a file (all plain ES modules from /static):
//   dom.js         element lookup and creation, the error banner
//   storage.js     localStorage: conversations, settings, the API key; the page's state
//   api.js         API errors, the key dialog, fetch() with the key
//   transport.js   the multiplexed WebSocket and the SSE fallback
//   generation.js  streaming an answer into a message; send, stop, regenerate
//   markdown.js    the safe Markdown renderer
//   view.js        rendering messages, the composer and the conversation list
//   metrics.js     the /metrics panel

import { $, el, showBanner } from "./dom.js";
import {
  DEFAULT_SETTINGS, currentConversation, newConversation, saveSettings, state,
} from "./storage.js";
import { apiErrorFrom, apiFetch, askApiKey } from "./api.js";
import { socket, updateTransportStatus } from "./transport.js";
import { renderMarkdown } from "./markdown.js";
import { closeSidebarOnPhone, renderAll } from "./view.js";
import { regenerate, send, stopCurrent } from "./generation.js";
import { pollMetrics } from "./metrics.js";

// ---- models and settings -------------------------------------------------------------------

async function loadModels() {
  try {
    const response = await apiFetch("/v1/models");
    if (!response.ok) throw await apiErrorFrom(response);
    state.models = (await response.json()).data || [];
    showBanner("");
  } catch (err) {
    showBanner(`Could not list the models: ${err.message}`);
    return;
  }
  const select = $("model");
  select.replaceChildren(
    ...state.models.map((model) => {
      const option = el("option", null, model.id);
      option.value = model.id;
      if (model.max_model_len) option.title = `max_model_len ${model.max_model_len}`;
      return option;
    }),
  );
  const ids = state.models.map((m) => m.id);
  if (!ids.includes(state.settings.model)) state.settings.model = ids[0] || "";
  select.value = state.settings.model;
  document.body.dataset.ready = "true"; // tests wait for this
  // Open the socket now, so the first answer does not wait for it (and the status is true).
  if (state.settings.transport !== "sse") socket.connect().catch(() => updateTransportStatus());
}

/** Binds a settings input to state.settings[key]; `parse` turns its text into the value. */
function bindSetting(id, key, parse) {
  const input = $(id);
  input.value = state.settings[key] ?? "";
  input.addEventListener("change", () => {
    state.settings[key] = parse(input.value);
    saveSettings();
    if (key === "transport") updateTransportStatus();
  });
}

const number = (fallback) => (text) => {
  const value = parseFloat(text);
  return Number.isFinite(value) ? value : fallback;
};

function setupSettings() {
  bindSetting("system-prompt", "systemPrompt", String);
  $("system-prompt").addEventListener("input", (e) => {
    state.settings.systemPrompt = e.target.value; // kept on every key, not only on blur
    saveSettings();
  });
  bindSetting("temperature", "temperature", number(DEFAULT_SETTINGS.temperature));
  bindSetting("top-p", "topP", number(DEFAULT_SETTINGS.topP));
  bindSetting("max-tokens", "maxTokens", (text) => {
    const value = parseInt(text, 10);
    return Number.isFinite(value) && value > 0 ? value : null;
  });
  bindSetting("transport", "transport", String);
  $("model").addEventListener("change", (e) => {
    state.settings.model = e.target.value;
    saveSettings();
  });
  // Settings also apply while typing (input), so a value typed just before Send counts.
  for (const id of ["temperature", "top-p", "max-tokens"]) {
    $(id).addEventListener("input", () => $(id).dispatchEvent(new Event("change")));
  }
  const toggle = $("toggle-settings");
  const panel = $("settings");
  const setOpen = (open) => {
    panel.hidden = !open;
    toggle.setAttribute("aria-expanded", String(open));
    if (open) $("system-prompt").focus();
  };
  toggle.addEventListener("click", () => setOpen(panel.hidden));
  $("close-settings").addEventListener("click", () => {
    setOpen(false);
    toggle.focus();
  });
  panel.addEventListener("keydown", (e) => {
    if (e.key === "Escape") {
      setOpen(false);
      toggle.focus();
    }
  });
  $("change-key").addEventListener("click", () => askApiKey("Enter the server's API key."));
}

function setupComposer() {
  const input = $("prompt");
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  input.addEventListener("keydown", (e) => {
    // Enter sends; Shift+Enter (or Enter while an IME composes) adds a line.
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("regenerate").addEventListener("click", regenerate);
  $("stop").addEventListener("click", () => {
    stopCurrent();
    input.focus();
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && !$("api-key-dialog").open && $("settings").hidden) stopCurrent();
  });
  $("new-chat").addEventListener("click", () => {
    newConversation();
    renderAll();
    closeSidebarOnPhone();
    input.focus();
  });
  $("toggle-sidebar").addEventListener("click", () => {
    const open = document.body.classList.toggle("sidebar-open");
    $("toggle-sidebar").setAttribute("aria-expanded", String(open));
  });
}

// ---- start ---------------------------------------------------------------------------------

// For tests and the console: the renderer, the state and the socket.
window.kvchat = Object.freeze({ renderMarkdown, state, socket });

if (state.currentId && !currentConversation()) state.currentId = null;
setupSettings();
setupComposer();
renderAll();
pollMetrics();
loadModels();
$("prompt").focus();

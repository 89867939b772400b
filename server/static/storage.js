// What the chat page keeps in localStorage (conversations, the open one, settings, the API key),
// and the page's state, loaded from it.

import { showBanner } from "./dom.js";

export const STORE = {
  conversations: "kvserve.conversations",
  current: "kvserve.current",
  settings: "kvserve.settings",
  apiKey: "kvserve.apiKey",
};
export const DEFAULT_SETTINGS = {
  systemPrompt: "",
  temperature: 0.7,
  topP: 1,
  maxTokens: 512,
  transport: "auto", // "auto" | "websocket" | "sse"
  model: "",
};

/** Reads JSON from localStorage; a missing or corrupt entry gives `fallback`. */
function loadJSON(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function saveJSON(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (err) {
    showBanner(`Could not save to localStorage: ${err.message}`);
  }
}

/** Stored conversations, cleaned: anything malformed is dropped, text stays text. */
function loadConversations() {
  const stored = loadJSON(STORE.conversations, []);
  if (!Array.isArray(stored)) return [];
  return stored
    .filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages))
    .map((c) => ({
      id: c.id,
      title: String(c.title ?? ""),
      updated: Number(c.updated) || 0,
      messages: c.messages
        .filter((m) => m && (m.role === "user" || m.role === "assistant"))
        .map((m) => ({
          role: m.role,
          content: String(m.content ?? ""),
          model: m.model ? String(m.model) : undefined,
          error: m.error ? String(m.error) : undefined,
          stats: m.stats && typeof m.stats === "object" ? m.stats : undefined,
          // An answer still streaming when the page closed was cut off there.
          state: m.state === "streaming" ? "interrupted" : m.state,
        })),
    }));
}

export const state = {
  conversations: loadConversations(),
  currentId: localStorage.getItem(STORE.current),
  settings: loadSettings(),
  apiKey: localStorage.getItem(STORE.apiKey) || "",
  models: [],
  // conversation id -> the Generation streaming into it (at most one per conversation)
  generations: new Map(),
};

/** Stored settings over the defaults, each kept only if it has the default's type. */
function loadSettings() {
  const stored = loadJSON(STORE.settings, {});
  const settings = { ...DEFAULT_SETTINGS };
  if (stored && typeof stored === "object") {
    for (const key of Object.keys(settings)) {
      const value = stored[key];
      if (key === "maxTokens" && value === null) settings.maxTokens = null; // server default
      else if (typeof value === typeof DEFAULT_SETTINGS[key]) settings[key] = value;
    }
  }
  return settings;
}

/** A random id; crypto.randomUUID exists only on https or localhost, this works on plain
 * http from another machine too. */
function randomId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

export function saveConversations() {
  saveJSON(STORE.conversations, state.conversations);
  if (state.currentId) localStorage.setItem(STORE.current, state.currentId);
}

export function saveSettings() {
  saveJSON(STORE.settings, state.settings);
}

export function currentConversation() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

export function newConversation() {
  const conv = { id: randomId(), title: "", updated: Date.now(), messages: [] };
  state.conversations.unshift(conv);
  state.currentId = conv.id;
  saveConversations();
  return conv;
}

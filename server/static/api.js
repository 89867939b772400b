// Calls to the server's API: its errors, the API key (asked for in a dialog on a 401, kept in
// localStorage) and fetch() with that key.

import { $ } from "./dom.js";
import { STORE, state } from "./storage.js";

/** An error as the server reported it: OpenAI's `error.message`, plus status and code. */
export class ApiError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Reads an error response: OpenAI's `{"error": {...}}` body, or its text otherwise. */
export async function apiErrorFrom(response) {
  const text = await response.text().catch(() => "");
  try {
    const error = JSON.parse(text).error;
    if (error && typeof error.message === "string") {
      return new ApiError(error.message, response.status, error.code ?? null);
    }
  } catch {
    // not JSON: fall through to the text
  }
  return new ApiError(text || `HTTP ${response.status} ${response.statusText}`, response.status);
}

function authHeaders() {
  return state.apiKey ? { Authorization: `Bearer ${state.apiKey}` } : {};
}

let keyRequest = null; // the one pending prompt for a key, shared by every caller

/** Shows the key dialog (once, however many requests got a 401); resolves with the key. */
export function askApiKey(reason) {
  if (keyRequest) return keyRequest;
  const dialog = $("api-key-dialog");
  $("api-key-message").textContent = reason || "This server needs an API key.";
  $("api-key-input").value = "";
  keyRequest = new Promise((resolve) => {
    const form = $("api-key-form");
    const onSubmit = (event) => {
      event.preventDefault();
      const key = $("api-key-input").value.trim();
      if (!key) return;
      form.removeEventListener("submit", onSubmit);
      dialog.removeEventListener("cancel", onCancel);
      dialog.close();
      keyRequest = null;
      setApiKey(key);
      resolve(key);
    };
    // Escape closes the dialog without a key; requests that needed it keep their 401 error.
    const onCancel = () => {
      form.removeEventListener("submit", onSubmit);
      dialog.removeEventListener("cancel", onCancel);
      keyRequest = null;
      resolve(null);
    };
    form.addEventListener("submit", onSubmit);
    dialog.addEventListener("cancel", onCancel);
  });
  dialog.showModal();
  $("api-key-input").focus();
  return keyRequest;
}

let keyChanged = () => {};

/** Sets what to do when the key changes (the transports reopen the socket). */
export function onApiKeyChange(callback) {
  keyChanged = callback;
}

function setApiKey(key) {
  state.apiKey = key;
  localStorage.setItem(STORE.apiKey, key);
  keyChanged(); // the socket authenticates when it opens: it reopens with the new key
}

/** fetch() with the key; a 401 asks for the key and retries with the new one. */
export async function apiFetch(path, options = {}) {
  const send = () =>
    fetch(path, { ...options, headers: { ...(options.headers || {}), ...authHeaders() } });
  let response = await send();
  while (response.status === 401) {
    const error = await apiErrorFrom(response);
    if (!(await askApiKey(error.message))) throw error; // the dialog was dismissed
    response = await send();
  }
  return response;
}

// kvserve's built-in chat page: plain JavaScript, no build step, nothing from a CDN.
//
// Answers stream over one multiplexed WebSocket (/v1/ws: each request carries an id, a cancel
// names that id) and fall back to SSE (POST /v1/chat/completions with stream: true) when the
// socket cannot be opened. Model text never becomes markup: the Markdown renderer builds DOM
// nodes and puts every piece of text in through textContent, so there is no innerHTML here.

const STORE = {
  conversations: "kvserve.conversations",
  current: "kvserve.current",
  settings: "kvserve.settings",
  apiKey: "kvserve.apiKey",
};
const DEFAULT_SETTINGS = {
  systemPrompt: "",
  temperature: 0.7,
  topP: 1,
  maxTokens: 512,
  transport: "auto", // "auto" | "websocket" | "sse"
  model: "",
};
const METRICS_INTERVAL_MS = 1000;
const SOCKET_RETRY_MS = 30000; // after a failed socket, "auto" uses SSE for this long
const SOCKET_OPEN_TIMEOUT_MS = 4000;
const TRANSPORT_NAMES = { websocket: "WebSocket", sse: "SSE" };

const $ = (id) => document.getElementById(id);

// ---- persisted state -----------------------------------------------------------------------

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

const state = {
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

function saveConversations() {
  saveJSON(STORE.conversations, state.conversations);
  if (state.currentId) localStorage.setItem(STORE.current, state.currentId);
}

function saveSettings() {
  saveJSON(STORE.settings, state.settings);
}

function currentConversation() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function newConversation() {
  const conv = { id: randomId(), title: "", updated: Date.now(), messages: [] };
  state.conversations.unshift(conv);
  state.currentId = conv.id;
  saveConversations();
  return conv;
}

// ---- errors and the API key ----------------------------------------------------------------

/** An error as the server reported it: OpenAI's `error.message`, plus status and code. */
class ApiError extends Error {
  constructor(message, status = 0, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Reads an error response: OpenAI's `{"error": {...}}` body, or its text otherwise. */
async function apiErrorFrom(response) {
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

function showBanner(text) {
  const banner = $("error-banner");
  banner.textContent = text;
  banner.hidden = !text;
}

function authHeaders() {
  return state.apiKey ? { Authorization: `Bearer ${state.apiKey}` } : {};
}

let keyRequest = null; // the one pending prompt for a key, shared by every caller

/** Shows the key dialog (once, however many requests got a 401); resolves with the key. */
function askApiKey(reason) {
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

function setApiKey(key) {
  state.apiKey = key;
  localStorage.setItem(STORE.apiKey, key);
  socket.reset(); // the socket authenticates when it opens: reopen it with the new key
}

/** fetch() with the key; a 401 asks for the key and retries with the new one. */
async function apiFetch(path, options = {}) {
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

// ---- transports ----------------------------------------------------------------------------
//
// Both transports take an OpenAI chat body and a handler object:
//   onChunk(chunk)                   one chat.completion.chunk, exactly as SSE carries it
//   onDone({finishReasons, usage})   the end ("abort" when stopped; usage may be absent)
//   onError(ApiError)                the end, with the server's error message
// and return {cancel()}; exactly one of onDone / onError is called.

/** The one multiplexed WebSocket, opened on first use and reopened after it closes. */
class SocketTransport {
  constructor() {
    this.ws = null;
    this.opening = null;
    this.handlers = new Map(); // request id -> handlers of requests in flight
    this.nextId = 1;
    this.failedAt = -Infinity;
    this.opened = 0; // sockets opened so far
  }

  url() {
    const url = new URL("/v1/ws", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    // Browsers cannot set headers on a WebSocket: the server takes the key as ?api_key=.
    if (state.apiKey) url.searchParams.set("api_key", state.apiKey);
    return url.href;
  }

  /** Whether "auto" should try the socket now (not within SOCKET_RETRY_MS of a failure). */
  usable() {
    return performance.now() - this.failedAt > SOCKET_RETRY_MS;
  }

  /** Resolves with an open socket; rejects if it cannot be opened. */
  connect() {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) return Promise.resolve(this.ws);
    if (this.opening) return this.opening;
    this.opening = new Promise((resolve, reject) => {
      let ws;
      try {
        ws = new WebSocket(this.url());
      } catch (err) {
        this.failedAt = performance.now();
        reject(err);
        return;
      }
      let opened = false;
      let failed = false;
      const fail = (reason) => {
        failed = true;
        this.failedAt = performance.now();
        reject(new Error(reason));
      };
      // A socket can also hang without a close event (Chromium does that when a policy
      // blocks it; so can a proxy that swallows the upgrade): give up on it after a while.
      const timer = setTimeout(() => {
        if (opened || failed) return;
        fail(`the WebSocket did not open within ${SOCKET_OPEN_TIMEOUT_MS / 1000} s`);
        ws.close();
        updateTransportStatus();
      }, SOCKET_OPEN_TIMEOUT_MS);
      ws.addEventListener("open", () => {
        clearTimeout(timer);
        if (failed) return; // too late: already closing
        opened = true;
        this.opened += 1;
        this.ws = ws;
        updateTransportStatus();
        resolve(ws);
      });
      ws.addEventListener("message", (event) => this.receive(event.data));
      ws.addEventListener("close", (event) => {
        clearTimeout(timer);
        if (this.ws === ws) this.ws = null;
        if (opened) this.closed(event);
        else if (!failed) fail(`the WebSocket could not be opened (code ${event.code})`);
        updateTransportStatus();
      });
      // An error is followed by close, which settles the promise.
    }).finally(() => {
      this.opening = null;
    });
    return this.opening;
  }

  async start(body, handlers) {
    const ws = await this.connect();
    const id = `chat-${this.nextId++}`;
    this.handlers.set(id, handlers);
    ws.send(JSON.stringify({ ...body, type: "chat", id }));
    return {
      cancel: () => {
        // The server answers a cancel with this id's done message (finish reason "abort").
        if (this.handlers.has(id) && ws.readyState === WebSocket.OPEN) {
          ws.send(JSON.stringify({ type: "cancel", id }));
        }
      },
    };
  }

  receive(data) {
    let message;
    try {
      message = JSON.parse(data);
    } catch {
      return;
    }
    if (message.type === "error" && message.id === null) {
      showBanner(message.error?.message || "WebSocket error");
      return;
    }
    const handlers = this.handlers.get(message.id);
    if (!handlers) return; // e.g. the answer to a cancel that crossed the request's end
    if (message.type === "delta") {
      handlers.onChunk(message.data);
    } else if (message.type === "done") {
      this.handlers.delete(message.id);
      handlers.onDone({ finishReasons: message.finish_reasons, usage: message.usage });
    } else if (message.type === "error") {
      this.handlers.delete(message.id);
      const e = message.error || {};
      handlers.onError(new ApiError(e.message || "unknown error", 0, e.code ?? null));
    }
  }

  /** The socket closed under running requests: each ends with an error. */
  closed(event) {
    const reason = `the WebSocket closed (code ${event.code}${event.reason ? `: ${event.reason}` : ""})`;
    const handlers = [...this.handlers.values()];
    this.handlers.clear();
    for (const h of handlers) h.onError(new ApiError(reason));
  }

  /** Closes the socket (e.g. the key changed); the next request opens a new one. */
  reset() {
    this.failedAt = -Infinity;
    if (this.ws) this.ws.close(1000, "reconnecting");
    this.ws = null;
  }
}

/** Server-sent events over fetch(); Stop aborts the fetch, which aborts the request. */
const sseTransport = {
  async start(body, handlers) {
    const controller = new AbortController();
    this.run(body, handlers, controller.signal);
    return { cancel: () => controller.abort() };
  },

  async run(body, handlers, signal) {
    let finishReasons = [];
    let usage;
    let ended = false;
    const end = (callback) => {
      if (!ended) {
        ended = true;
        callback();
      }
    };
    try {
      const response = await apiFetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal,
      });
      if (!response.ok) throw await apiErrorFrom(response);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        // Events end with a blank line; keep the unfinished tail for the next read.
        const events = buffer.split(/\r?\n\r?\n/);
        buffer = events.pop();
        for (const event of events) {
          const data = event
            .split(/\r?\n/)
            .filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5).replace(/^ /, ""))
            .join("\n");
          if (!data) continue;
          if (data === "[DONE]") {
            end(() => handlers.onDone({ finishReasons, usage }));
            continue;
          }
          const chunk = JSON.parse(data);
          if (chunk.error) {
            // An error after the stream began arrives in-stream, then [DONE].
            const e = chunk.error;
            end(() => handlers.onError(new ApiError(e.message || "error", 0, e.code ?? null)));
            continue;
          }
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            if (choice.finish_reason) finishReasons[choice.index || 0] = choice.finish_reason;
          }
          if (!ended) handlers.onChunk(chunk);
        }
      }
      end(() => handlers.onError(new ApiError("the stream ended without [DONE]")));
    } catch (err) {
      if (signal.aborted) {
        finishReasons = ["abort"];
        end(() => handlers.onDone({ finishReasons, usage }));
      } else if (err instanceof ApiError) {
        end(() => handlers.onError(err));
      } else {
        end(() => handlers.onError(new ApiError(`network error: ${err.message}`)));
      }
    }
  },
};

const socket = new SocketTransport();

/** Starts `body` on the transport the settings ask for; "auto" falls back to SSE when the
 * socket cannot be opened. Resolves with {transport, cancel}. */
async function startStream(body, handlers) {
  const mode = state.settings.transport;
  if (mode === "websocket" || (mode === "auto" && socket.usable())) {
    try {
      const call = await socket.start(body, handlers);
      return { transport: "websocket", ...call };
    } catch (err) {
      if (mode === "websocket") throw new ApiError(err.message);
      console.warn("kvserve: WebSocket unavailable, falling back to SSE:", err.message);
      updateTransportStatus();
    }
  }
  const call = await sseTransport.start(body, handlers);
  return { transport: "sse", ...call };
}

function updateTransportStatus() {
  const el = $("transport-status");
  const mode = state.settings.transport;
  let text;
  if (mode === "sse") text = "SSE";
  else if (socket.ws) text = "WebSocket";
  else if (mode === "auto" && !socket.usable()) text = "SSE (socket unavailable)";
  else text = mode === "websocket" ? "WebSocket (closed)" : "WebSocket / SSE";
  el.textContent = text;
}

// ---- generation ----------------------------------------------------------------------------

/** The messages sent for a conversation: the system prompt, then every turn that has text.
 * A turn whose answer failed (say, a prompt over max_model_len) is left out, question and
 * error both, so the conversation can go on; a stopped answer keeps what it said. */
function requestMessages(conv) {
  const messages = [];
  const system = state.settings.systemPrompt.trim();
  if (system) messages.push({ role: "system", content: state.settings.systemPrompt });
  conv.messages.forEach((m, i) => {
    const next = conv.messages[i + 1];
    if (m.role === "user" && next?.role === "assistant" && next.error) return;
    if (m.role === "assistant" && (m.error || !m.content)) return;
    messages.push({ role: m.role, content: m.content });
  });
  return messages;
}

function requestBody(conv) {
  const s = state.settings;
  const body = {
    model: s.model || undefined,
    messages: requestMessages(conv),
    stream: true,
    stream_options: { include_usage: true },
    temperature: s.temperature,
    top_p: s.topP,
  };
  if (s.maxTokens) body.max_tokens = s.maxTokens;
  return body;
}

/** One answer being streamed into `message` of `conv`. */
class Generation {
  constructor(conv, message) {
    this.conv = conv;
    this.message = message;
    this.call = null;
    this.stopRequested = false;
    this.startedAt = performance.now();
    this.firstAt = null;
    this.lastAt = null;
    this.deltas = 0; // content deltas so far: the live token count until usage arrives
  }

  async start() {
    const body = requestBody(this.conv);
    this.message.model = body.model; // the name asked for (the picker's choice)
    try {
      const call = await startStream(body, {
        onChunk: (chunk) => this.chunk(chunk),
        onDone: (info) => this.done(info),
        onError: (err) => this.fail(err),
      });
      this.call = call;
      this.message.stats.transport = call.transport;
      renderMessageSoon(this.message);
      if (this.stopRequested) call.cancel(); // Stop was pressed while the socket opened
    } catch (err) {
      this.fail(err instanceof ApiError ? err : new ApiError(err.message));
    }
  }

  stop() {
    this.stopRequested = true;
    if (this.call) this.call.cancel();
  }

  chunk(chunk) {
    if (chunk.usage) this.usage(chunk.usage);
    const choice = (chunk.choices || [])[0];
    if (!choice) return;
    const text = choice.delta?.content;
    if (text) {
      const now = performance.now();
      if (this.firstAt === null) {
        this.firstAt = now;
        this.message.stats.ttftMs = now - this.startedAt;
      }
      this.lastAt = now;
      this.deltas += 1;
      this.message.content += text;
      this.updateRate(this.deltas);
    }
    if (choice.finish_reason) this.message.stats.finishReason = choice.finish_reason;
    renderMessageSoon(this.message);
  }

  usage(usage) {
    this.message.stats.promptTokens = usage.prompt_tokens;
    this.message.stats.completionTokens = usage.completion_tokens;
    this.updateRate(usage.completion_tokens);
  }

  /** Tokens per second after the first token (the decode rate, as benchmarks report it). */
  updateRate(tokens) {
    const seconds = (this.lastAt - this.firstAt) / 1000;
    if (this.firstAt !== null && tokens > 1 && seconds > 0) {
      this.message.stats.tokensPerS = (tokens - 1) / seconds;
    }
  }

  done({ finishReasons, usage }) {
    if (usage) this.usage(usage);
    const reason = (finishReasons || [])[0] || this.message.stats.finishReason || "stop";
    this.message.stats.finishReason = reason;
    this.finish(reason === "abort" ? "stopped" : "done");
  }

  /** The server's error message is shown under the answer (a 401 already asked for the key
   * in apiFetch; the user can Regenerate once it is set). */
  fail(err) {
    this.message.error = err.message;
    this.finish("error");
  }

  finish(messageState) {
    this.message.state = messageState;
    if (state.generations.get(this.conv.id) === this) state.generations.delete(this.conv.id);
    this.conv.updated = Date.now();
    saveConversations();
    renderMessageSoon(this.message);
    renderComposer();
  }
}

/** Appends an empty assistant message to `conv` and streams the answer into it. */
function generate(conv) {
  const message = { role: "assistant", content: "", state: "streaming", stats: {} };
  conv.messages.push(message);
  const generation = new Generation(conv, message);
  state.generations.set(conv.id, generation);
  saveConversations();
  renderMessages();
  renderComposer();
  generation.start();
}

function send() {
  const input = $("prompt");
  const text = input.value;
  if (!text.trim()) return;
  const conv = currentConversation() || newConversation();
  if (state.generations.has(conv.id)) return; // one answer at a time per conversation
  conv.messages.push({ role: "user", content: text });
  if (!conv.title) conv.title = text.trim().slice(0, 60);
  conv.updated = Date.now();
  input.value = "";
  renderConversationList();
  generate(conv);
}

function stopCurrent() {
  const generation = state.generations.get(state.currentId);
  if (generation) generation.stop();
}

/** Replaces the last answer with a new one; a running answer is cancelled first, and both
 * requests share the socket until the old one's cancel lands. */
function regenerate() {
  const conv = currentConversation();
  if (!conv) return;
  const running = state.generations.get(conv.id);
  if (running) running.stop();
  while (conv.messages.length && conv.messages.at(-1).role === "assistant") conv.messages.pop();
  if (!conv.messages.length) return;
  generate(conv);
}

// ---- safe Markdown -------------------------------------------------------------------------
//
// A small Markdown subset (fenced code, headings, lists, quotes, rules, paragraphs; inline
// code, bold, italics, strikethrough, http(s)/mailto links) rendered by creating elements and
// setting textContent: the text is never parsed as HTML, so `<script>` stays text.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const LIST_ITEM = /^ {0,3}([-*+]|\d{1,9}[.)])\s+(.*)$/;
const INLINE =
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__(?!\w)|\*(?=[^\s*])([\s\S]*?[^\s*])\*|(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)|~~(?=\S)([\s\S]*?\S)~~|\[([^\]\n]+)\]\(([^()\s]+)\)/g;
const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/** A link's URL if it is http(s) or mailto, resolved against the page; otherwise null. */
function safeUrl(raw) {
  try {
    const url = new URL(raw, location.href);
    return SAFE_PROTOCOLS.has(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

/** Inline Markdown of `text` appended to `parent`, as text nodes and formatting elements. */
function renderInline(text, parent) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    const [whole, , code, strong1, strong2, em1, em2, del, linkText, linkUrl] = match;
    if (code !== undefined) {
      parent.append(el("code", null, code));
    } else if (strong1 !== undefined || strong2 !== undefined) {
      renderInline(strong1 ?? strong2, parent.appendChild(el("strong")));
    } else if (em1 !== undefined || em2 !== undefined) {
      renderInline(em1 ?? em2, parent.appendChild(el("em")));
    } else if (del !== undefined) {
      renderInline(del, parent.appendChild(el("del")));
    } else {
      const href = safeUrl(linkUrl);
      if (href) {
        const a = el("a");
        a.href = href;
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        renderInline(linkText, a);
        parent.append(a);
      } else {
        parent.append(whole); // a javascript: or data: link stays visible as plain text
      }
    }
    last = match.index + whole.length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function codeBlock(lang, lines) {
  const wrapper = el("div", "code-block");
  const header = el("div", "code-header");
  header.append(el("span", "code-lang", lang || "code"));
  const copy = el("button", "copy-code", "Copy");
  copy.type = "button";
  const code = el("code", null, lines.join("\n"));
  if (lang) code.dataset.lang = lang;
  copy.addEventListener("click", () => {
    // The clipboard API exists only on https or localhost.
    if (!navigator.clipboard) {
      copy.textContent = "Select the text to copy";
      return;
    }
    navigator.clipboard.writeText(code.textContent).then(
      () => (copy.textContent = "Copied"),
      () => (copy.textContent = "Copy failed"),
    );
  });
  header.append(copy);
  const pre = el("pre");
  pre.append(code);
  wrapper.append(header, pre);
  return wrapper;
}

/** Markdown `text` as a DocumentFragment; safe for any input, including partial streams
 * (an unclosed code fence runs to the end). */
function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  const startsBlock = (line) =>
    FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    LIST_ITEM.test(line);
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const body = [];
      i += 1;
      while (i < lines.length && !isClosingFence(lines[i], fence)) body.push(lines[i++]);
      i += 1; // the closing fence, if any
      fragment.append(codeBlock(m[2], body));
    } else if ((m = HEADING.exec(line))) {
      const heading = el(`h${Math.min(m[1].length + 2, 6)}`, "md-heading");
      renderInline(m[2], heading);
      fragment.append(heading);
      i += 1;
    } else if (RULE.test(line)) {
      fragment.append(el("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        body.push(m[1]);
        i += 1;
      }
      const quote = el("blockquote");
      quote.append(renderMarkdown(body.join("\n")));
      fragment.append(quote);
    } else if ((m = LIST_ITEM.exec(line))) {
      const ordered = /\d/.test(m[1]);
      const list = el(ordered ? "ol" : "ul");
      if (ordered && parseInt(m[1], 10) !== 1) list.start = parseInt(m[1], 10);
      while (i < lines.length && (m = LIST_ITEM.exec(lines[i])) && /\d/.test(m[1]) === ordered) {
        const item = el("li");
        const body = [m[2]];
        i += 1;
        // Indented lines continue the item.
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !LIST_ITEM.test(lines[i])) {
          body.push(lines[i++].trim());
        }
        renderInline(body.join("\n"), item);
        list.append(item);
      }
      fragment.append(list);
    } else {
      const body = [line];
      i += 1;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) body.push(lines[i++]);
      const paragraph = el("p");
      renderInline(body.join("\n"), paragraph);
      fragment.append(paragraph);
    }
  }
  return fragment;
}

function isClosingFence(line, fence) {
  const trimmed = line.trim();
  return trimmed.length >= fence.length && trimmed === fence[0].repeat(trimmed.length);
}

// ---- rendering -----------------------------------------------------------------------------

const messageNodes = new WeakMap(); // message object -> its <li>, while it is on screen
const dirty = new Set();
let frameRequested = false;

/** Re-renders a message on the next animation frame (streams update many times a frame). */
function renderMessageSoon(message) {
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

function renderMessages() {
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

function renderComposer() {
  const busy = state.generations.has(state.currentId);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  // Regenerate replaces the last answer; it sits in the composer, where it does not move
  // while an answer grows.
  const last = currentConversation()?.messages.at(-1);
  $("regenerate").hidden = last?.role !== "assistant";
  document.body.dataset.busy = String(busy);
}

function renderConversationList() {
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

function renderAll() {
  renderConversationList();
  renderMessages();
  renderComposer();
  updateTransportStatus();
}

// ---- models, metrics and settings ----------------------------------------------------------

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

/** The samples of a Prometheus text page, summed by name over their labels. */
function parsePrometheus(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    const m = /^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)/.exec(line);
    if (m) values.set(m[1], (values.get(m[1]) || 0) + Number(m[2]));
  }
  return values;
}

async function pollMetrics() {
  if (document.visibilityState === "visible") {
    try {
      const response = await fetch("/metrics", { cache: "no-store" });
      if (response.ok) showMetrics(parsePrometheus(await response.text()));
    } catch {
      // the server is away; keep the last figures
    }
  }
  setTimeout(pollMetrics, METRICS_INTERVAL_MS);
}

function showMetrics(values) {
  const get = (name) => values.get(`kvserve:${name}`);
  const running = get("num_requests_running");
  const waiting = get("num_requests_waiting");
  const usage = get("kv_cache_usage_perc");
  const hits = get("prefix_cache_hits_total");
  const queries = get("prefix_cache_queries_total");
  $("metric-running").textContent = running === undefined ? "–" : String(running);
  $("metric-waiting").textContent = waiting === undefined ? "–" : String(waiting);
  $("metric-kv").textContent = usage === undefined ? "–" : `${(usage * 100).toFixed(1)}%`;
  $("metric-prefix").textContent = queries ? `${((100 * hits) / queries).toFixed(1)}%` : "–";
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

function closeSidebarOnPhone() {
  if (window.matchMedia("(max-width: 700px)").matches) {
    document.body.classList.remove("sidebar-open");
    $("toggle-sidebar").setAttribute("aria-expanded", "false");
  }
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

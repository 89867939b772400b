// How answers stream: one multiplexed WebSocket (/v1/ws: each request carries an id, a cancel
// names that id), falling back to SSE (POST /v1/chat/completions with stream: true) when the
// socket cannot be opened.

import { $, showBanner } from "./dom.js";
import { state } from "./storage.js";
import { ApiError, apiErrorFrom, apiFetch, onApiKeyChange } from "./api.js";

const SOCKET_RETRY_MS = 30000; // after a failed socket, "auto" uses SSE for this long
const SOCKET_OPEN_TIMEOUT_MS = 4000;
export const TRANSPORT_NAMES = { websocket: "WebSocket", sse: "SSE" };

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

export const socket = new SocketTransport();
onApiKeyChange(() => socket.reset()); // a new key: reopen the socket with it

/** Starts `body` on the transport the settings ask for; "auto" falls back to SSE when the
 * socket cannot be opened. Resolves with {transport, cancel}. */
export async function startStream(body, handlers) {
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

export function updateTransportStatus() {
  const el = $("transport-status");
  const mode = state.settings.transport;
  let text;
  if (mode === "sse") text = "SSE";
  else if (socket.ws) text = "WebSocket";
  else if (mode === "auto" && !socket.usable()) text = "SSE (socket unavailable)";
  else text = mode === "websocket" ? "WebSocket (closed)" : "WebSocket / SSE";
  el.textContent = text;
}

// Generating answers: the request for a conversation, one answer streaming into its message
// (with its figures: TTFT, tokens per second, token counts), and send / stop / regenerate.

import { $ } from "./dom.js";
import { currentConversation, newConversation, saveConversations, state } from "./storage.js";
import { ApiError } from "./api.js";
import { startStream } from "./transport.js";
import {
  renderComposer, renderConversationList, renderMessageSoon, renderMessages,
} from "./view.js";

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

export function send() {
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

export function stopCurrent() {
  const generation = state.generations.get(state.currentId);
  if (generation) generation.stop();
}

/** Replaces the last answer with a new one; a running answer is cancelled first, and both
 * requests share the socket until the old one's cancel lands. */
export function regenerate() {
  const conv = currentConversation();
  if (!conv) return;
  const running = state.generations.get(conv.id);
  if (running) running.stop();
  while (conv.messages.length && conv.messages.at(-1).role === "assistant") conv.messages.pop();
  if (!conv.messages.length) return;
  generate(conv);
}

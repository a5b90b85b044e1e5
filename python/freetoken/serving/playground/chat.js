// Chat mode: a conversation of turns, sent whole as `messages` to one streamed
// /v1/chat/completions per reply. An assistant turn shows its tokens in the sections the
// server's parsers put them in: content and reasoning tokens carry their logprob entries
// (`logprobs.content`, `reasoning_logprobs.content`); tool-call and marker tokens have none in
// the API, so calls are shown as calls, with their arguments. A user turn can be edited and
// resent: the turns after it are dropped and it is answered again.

import { postStream } from "./api.js";
import { addText, addToken, tokenList } from "./tokens.js";
import { addTurn, addUserTurn, cut, lock, takeResend, turns } from "./turns.js";
import { compact, renderMeta, settings, value } from "./ui.js";

export const EXAMPLE_TOOLS = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "The weather in a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
}];

const messageBox = () => document.getElementById("chat-user");

function chatBody(model, history) {
  const s = settings();
  const messages = [];
  if (value("chat-system").trim()) messages.push({ role: "system", content: value("chat-system") });
  messages.push(...history);
  let tools = null;
  if (value("chat-tools").trim()) {
    try {
      tools = JSON.parse(value("chat-tools"));
    } catch (error) {
      throw new Error(`The tools are not valid JSON: ${error.message}`);
    }
  }
  const probabilities = s.k !== null;
  return compact({
    model, messages, tools,
    ...s.sampling,
    logprobs: probabilities || null,
    top_logprobs: probabilities ? s.k : null,
    include_reasoning_logprobs: probabilities || null,
    chat_template_kwargs: s.reasoning ? { enable_thinking: s.reasoning === "on" } : null,
    stream: true,
    stream_options: { include_usage: true },
  });
}

function chatEntry(e, decoder, k) {
  // The bytes, decoded as a stream: a character split across tokens shows on the token that
  // completes it, and the ones before it are blank.
  const text = e.bytes ? decoder.decode(new Uint8Array(e.bytes), { stream: true }) : e.token;
  const top = e.top_logprobs || [];
  const at = top.findIndex((t) => t.token === e.token && t.logprob === e.logprob);
  const note = e.bytes && !text ? "Part of a character that a later token completes." : null;
  return { text, token: e.token, logprob: e.logprob, rank: at >= 0 ? at + 1 : null, top, k, note };
}

// One assistant turn's reply as it streams in.
class ChatView {
  constructor(container, k) {
    this.container = container;
    this.k = k;
    this.reasoningBox = document.createElement("details");
    this.reasoningBox.className = "reasoning";
    this.reasoningBox.open = true;
    this.reasoningBox.hidden = true;
    this.reasoningTitle = document.createElement("summary");
    this.reasoningTitle.textContent = "Reasoning";
    this.reasoning = tokenList("reasoning", "Reasoning tokens");
    this.reasoningBox.append(this.reasoningTitle, this.reasoning);
    this.content = tokenList("content", "Answer tokens");
    this.calls = document.createElement("div");
    this.calls.className = "calls";
    this.callViews = new Map();
    this.decoders = { reasoning: new TextDecoder(), content: new TextDecoder() };
    this.text = "";
    this.finish = null;
    this.usage = null;
    container.append(this.reasoningBox, this.content, this.calls);
  }

  add(list, label, text, entries) {
    if (entries?.length) {
      for (const e of entries) addToken(list, label, chatEntry(e, this.decoders[label], this.k));
    } else if (text) {
      addText(list, label, text);
    }
  }

  chunk(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      const reasoning = choice.reasoning_logprobs?.content;
      if (delta.reasoning_content || reasoning?.length) {
        this.reasoningBox.hidden = false;
        this.add(this.reasoning, "reasoning", delta.reasoning_content, reasoning);
        const count = this.reasoning.querySelectorAll(".tok").length;
        this.reasoningTitle.textContent = count ? `Reasoning (${count} tokens)` : "Reasoning";
      }
      this.text += delta.content || "";
      this.add(this.content, "content", delta.content, choice.logprobs?.content);
      for (const call of delta.tool_calls || []) this.call(call);
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
  }

  call(delta) {
    let view = this.callViews.get(delta.index);
    if (!view) {
      const box = document.createElement("div");
      box.className = "call";
      box.dataset.label = "tool_call";
      const name = document.createElement("p");
      name.className = "call-name";
      const args = document.createElement("pre");
      args.className = "call-args";
      box.append(name, args);
      this.calls.append(box);
      view = { id: delta.id, name: "", nameView: name, args, text: "" };
      this.callViews.set(delta.index, view);
    }
    if (delta.function?.name) {
      view.name = delta.function.name;
      view.nameView.textContent = `Tool call: ${view.name}`;
    }
    view.text += delta.function?.arguments || "";
    view.args.textContent = view.text;
  }

  // The reply as the next request's history holds it: its reasoning left out (templates such
  // as Qwen3's drop an earlier turn's reasoning anyway).
  end() {
    for (const view of this.callViews.values()) {
      try {
        view.args.textContent = JSON.stringify(JSON.parse(view.text), null, 2);
      } catch (_) { /* cut short (finish_reason length): shown as sent */ }
    }
    renderMeta(this.container, this.finish, this.usage);
    const calls = [...this.callViews.values()].map((v) => ({
      id: v.id, type: "function", function: { name: v.name, arguments: v.text } }));
    const toolCalls = calls.length ? calls : null;
    return compact({ role: "assistant", content: this.text, tool_calls: toolCalls });
  }
}

export async function runChat(output, model, log, signal) {
  const at = takeResend();
  const text = at === null ? messageBox().value : null;
  if (text !== null && !text.trim()) throw new Error("Write a message.");
  const history = turns.slice(0, at === null ? turns.length : at + 1).map((t) => t.message);
  if (text !== null) history.push({ role: "user", content: text });
  const body = chatBody(model, history);
  const added = text !== null ? addUserTurn(text) : null;
  if (added) messageBox().value = "";
  else cut(at + 1);
  const reply = addTurn("assistant", null);
  reply.view = new ChatView(reply.element, body.top_logprobs ?? null);
  lock(true);
  let failure = null;
  try {
    const onChunk = (chunk) => reply.view.chunk(chunk);
    await postStream("/v1/chat/completions", body, log, signal, onChunk);
  } catch (error) {
    failure = error;
  }
  lock(false);
  if (failure && failure.name !== "AbortError") {
    // No reply: a new message goes back into the box, to be sent again.
    cut(turns.indexOf(added ?? reply));
    if (added) messageBox().value = text;
  } else {
    reply.message = reply.view.end();  // stopped: the reply so far is kept
  }
  if (failure) throw failure;
}

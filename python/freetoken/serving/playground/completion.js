// Completion mode: one streamed /v1/completions with `logprobs: K`, a span per token.

import { postStream } from "./api.js";
import { addText, addToken, tokenList } from "./tokens.js";
import { compact, renderMeta, settings, value } from "./ui.js";

function completionBody(model) {
  const s = settings();
  return compact({
    model,
    prompt: value("completion-prompt"),
    ...s.sampling,
    logprobs: s.k,
    stream: true,
    stream_options: { include_usage: true },
  });
}

// top: the sampled token first, then the top k (k + 1 entries when the sampled one is not
// among them).
function completionEntry(token, logprob, top, k) {
  const alternatives = Object.entries(top || {}).map(([t, lp]) => ({ token: t, logprob: lp }))
    .sort((a, b) => b.logprob - a.logprob);
  const inTop = k > 0 && alternatives.length <= k;
  const rank = inTop ? 1 + alternatives.filter((a) => a.logprob > logprob).length : null;
  return { text: token, logprob, rank, top: alternatives, k };
}

export async function runCompletion(output, model, log, signal) {
  const body = completionBody(model);
  const list = tokenList("text", "Completion tokens");
  output.append(list);
  let text = "", finish = null, usage = null;
  await postStream("/v1/completions", body, log, signal, (chunk) => {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      text += choice.text || "";
      const lp = choice.logprobs;
      if (lp) {
        lp.tokens.forEach((token, i) => addToken(list, "text",
          completionEntry(token, lp.token_logprobs[i], lp.top_logprobs?.[i], body.logprobs)));
      } else if (choice.text) {
        addText(list, "text", choice.text);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  });
  // The EOS or stop token that ended the turn is listed without being part of the text.
  let at = 0;
  for (const span of list.querySelectorAll(".tok")) {
    if (at >= text.length) {
      span.dataset.label = "special";
      const note = "Ended the turn; not part of the text.";
      span.entry = { ...span.entry, label: "special", note };
    }
    at += span.entry.text.length;
  }
  renderMeta(output, finish, usage);
}

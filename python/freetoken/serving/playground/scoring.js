// Scoring mode (docs/scoring.md): each label tokenized by the server's /tokenize, then one
// /v1/completions request for all prompts with `allowed_token_ids`, whose logprobs come back
// renormalised over the labels. One request scores one position, so a label counts by its
// first token: a multi-token label is flagged, and labels that share a first token are refused.

import { postJSON } from "./api.js";
import { percent, shown } from "./tokens.js";
import { value } from "./ui.js";

const SVG = "http://www.w3.org/2000/svg";

function scoringInput() {
  const prompts = value("scoring-prompts").split(/^---$/m)
    .map((p) => p.replace(/^\n/, "").replace(/\n$/, "")).filter((p) => p.trim());
  const labels = value("scoring-labels").split("\n").filter((l) => l.trim());
  if (!prompts.length) throw new Error("Give at least one prompt.");
  if (labels.length < 2) throw new Error("Give at least two labels, one a line.");
  return { prompts, labels };
}

async function labelTokens(labels, log, signal) {
  const tokenized = await Promise.all(labels.map((label) =>
    postJSON("/tokenize", { prompt: label, add_special_tokens: false }, log, signal)));
  const out = labels.map((label, i) => ({ label, ids: tokenized[i].tokens }));
  const seen = new Map();
  for (const { label, ids } of out) {
    if (!ids.length) throw new Error(`The label ${shown(label)} has no tokens.`);
    if (seen.has(ids[0])) {
      const other = shown(seen.get(ids[0]));
      throw new Error(`The labels ${other} and ${shown(label)} start with the same token ` +
        `(${ids[0]}): one position cannot tell them apart.`);
    }
    seen.set(ids[0], label);
  }
  return out;
}

function scoringBody(model, prompts, labels) {
  return {
    ...(model ? { model } : {}),
    prompt: prompts.length === 1 ? prompts[0] : prompts,
    max_tokens: 1,
    temperature: 0,
    logprobs: labels.length,
    allowed_token_ids: labels.map((l) => l.ids[0]),
    return_tokens_as_token_ids: true,
  };
}

function chart(prompt, scores) {
  const rowHeight = 28, labelWidth = 140, barWidth = 300, width = labelWidth + barWidth + 150;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("viewBox", `0 0 ${width} ${rowHeight * scores.length + 4}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `Label probabilities for ${shown(prompt)}: ` +
    scores.map((s) => `${s.label.trim() || shown(s.label)} ${percent(s.logprob)}`).join(", "));
  scores.forEach((s, i) => {
    const y = i * rowHeight + 2;
    const name = document.createElementNS(SVG, "text");
    name.setAttribute("x", labelWidth - 8);
    name.setAttribute("y", y + rowHeight / 2 + 5);
    name.setAttribute("text-anchor", "end");
    name.textContent = shown(s.label);
    const back = document.createElementNS(SVG, "rect");
    back.setAttribute("class", "bar-back");
    back.setAttribute("x", labelWidth);
    back.setAttribute("y", y + 4);
    back.setAttribute("width", barWidth);
    back.setAttribute("height", rowHeight - 8);
    const bar = document.createElementNS(SVG, "rect");
    bar.setAttribute("class", "bar");
    bar.setAttribute("x", labelWidth);
    bar.setAttribute("y", y + 4);
    bar.setAttribute("width", (barWidth * Math.exp(s.logprob)).toFixed(2));
    bar.setAttribute("height", rowHeight - 8);
    bar.dataset.label = s.label;
    bar.dataset.logprob = String(s.logprob);
    const figure = document.createElementNS(SVG, "text");
    figure.setAttribute("x", labelWidth + barWidth + 8);
    figure.setAttribute("y", y + rowHeight / 2 + 5);
    figure.textContent = `${percent(s.logprob)}  (${s.logprob.toFixed(4)})`;
    svg.append(name, back, bar, figure);
  });
  return svg;
}

function table(rows, labels) {
  const t = document.createElement("table");
  t.className = "scores";
  t.createCaption().textContent =
    "Renormalised probability over the labels, and its logprob as the API returned it";
  const head = t.createTHead().insertRow();
  for (const name of ["Prompt", ...labels.map((l) => shown(l.label)), "Chosen"]) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = name;
    head.append(th);
  }
  const body = t.createTBody();
  for (const { prompt, scores, chosen } of rows) {
    const row = body.insertRow();
    const th = document.createElement("th");
    th.scope = "row";
    th.textContent = prompt;
    row.append(th);
    const best = Math.max(...scores.map((s) => s.logprob));
    for (const s of scores) {
      const cell = row.insertCell();
      cell.className = "score";
      if (s.logprob === best) cell.classList.add("best");
      cell.dataset.logprob = String(s.logprob);
      const bar = document.createElement("span");
      bar.className = "cell-bar";
      bar.style.setProperty("--w", Math.exp(s.logprob).toFixed(4));
      cell.append(bar, `${percent(s.logprob)} (${s.logprob.toFixed(4)})`);
    }
    row.insertCell().textContent = shown(chosen);
  }
  return t;
}

export async function runScoring(output, model, log, signal) {
  const { prompts, labels } = scoringInput();
  const tokens = await labelTokens(labels, log, signal);
  const body = scoringBody(model, prompts, tokens);
  const response = await postJSON("/v1/completions", body, log, signal);
  const rows = prompts.map((prompt, p) => {
    const choice = response.choices.find((c) => c.index === p);
    const top = choice.logprobs.top_logprobs[0];
    const chosenId = Number(choice.logprobs.tokens[0].replace("token_id:", ""));
    return {
      prompt,
      scores: tokens.map(({ label, ids }) => ({ label, logprob: top[`token_id:${ids[0]}`] })),
      chosen: tokens.find((t) => t.ids[0] === chosenId)?.label ?? `token ${chosenId}`,
    };
  });
  const multi = tokens.filter((t) => t.ids.length > 1);
  if (multi.length) {
    const note = document.createElement("p");
    note.className = "note";
    const named = multi.map((t) => `${shown(t.label)} (${t.ids.length} tokens)`);
    note.textContent = `Scored by their first token: ${named.join(", ")}.`;
    output.append(note);
  }
  if (rows.length === 1) output.append(chart(rows[0].prompt, rows[0].scores));
  output.append(table(rows, tokens));
}

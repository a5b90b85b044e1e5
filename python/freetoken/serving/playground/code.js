// A recorded request as a curl command and as Python: the openai SDK for /v1 routes (the
// fields the SDK does not declare go in extra_body, as vLLM documents), httpx for the others.
// The key is read from $FREETOKEN_API_KEY rather than copied into the clipboard.

const KEY_VAR = "FREETOKEN_API_KEY";

// Arguments the openai SDK's create() declares; anything else is a vLLM field.
const SDK_FIELDS = {
  "/v1/chat/completions": new Set(["model", "messages", "temperature", "top_p", "seed",
    "max_tokens", "max_completion_tokens", "stop", "logprobs", "top_logprobs", "tools",
    "tool_choice", "stream", "stream_options", "n", "presence_penalty", "frequency_penalty",
    "logit_bias", "response_format", "user", "parallel_tool_calls"]),
  "/v1/completions": new Set(["model", "prompt", "temperature", "top_p", "seed", "max_tokens",
    "stop", "logprobs", "echo", "stream", "stream_options", "n", "presence_penalty",
    "frequency_penalty", "logit_bias", "best_of", "suffix", "user"]),
};
const SDK_METHOD = { "/v1/chat/completions": "chat.completions", "/v1/completions": "completions" };

function shellQuote(text) {
  return `'${text.replaceAll("'", "'\\''")}'`;
}

export function curl(origin, request, withKey) {
  const lines = [`curl ${request.body?.stream ? "-N " : ""}${origin}${request.path}`];
  if (withKey) lines.push(`-H "Authorization: Bearer $${KEY_VAR}"`);
  if (request.method === "POST") {
    lines.push("-H 'Content-Type: application/json'");
    lines.push(`-d ${shellQuote(JSON.stringify(request.body, null, 2))}`);
  }
  return lines.join(" \\\n  ");
}

// A JSON value as a Python literal, indented like json.dumps(indent=4).
function pyLiteral(value, indent = 0) {
  const pad = " ".repeat(indent + 4), end = " ".repeat(indent);
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "number") return String(value);
  if (typeof value === "string") return JSON.stringify(value);
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return `[\n${value.map((v) => pad + pyLiteral(v, indent + 4)).join(",\n")},\n${end}]`;
  }
  const keys = Object.keys(value);
  if (!keys.length) return "{}";
  const items = keys.map((k) => `${pad}${JSON.stringify(k)}: ${pyLiteral(value[k], indent + 4)}`);
  return `{\n${items.join(",\n")},\n${end}}`;
}

export function python(origin, request, withKey) {
  const key = withKey ? `os.environ["${KEY_VAR}"]` : `"none"`;
  const sdkFields = SDK_FIELDS[request.path];
  if (!sdkFields) {
    // Not an f-string: one holding os.environ["..."] needs Python 3.12.
    const auth = withKey ? `, headers={"Authorization": "Bearer " + ${key}}` : "";
    const call = request.method === "POST"
      ? `httpx.post("${origin}${request.path}", json=${pyLiteral(request.body)}${auth})`
      : `httpx.get("${origin}${request.path}"${auth})`;
    const head = withKey ? "import os\n\nimport httpx" : "import httpx";
    return `${head}\n\nresponse = ${call}\nprint(response.json())\n`;
  }
  const body = { model: null, ...request.body };
  const args = [], extra = {};
  for (const [name, value] of Object.entries(body)) {
    if (sdkFields.has(name)) args.push(`    ${name}=${pyLiteral(value, 4)},`);
    else extra[name] = value;
  }
  if (Object.keys(extra).length) args.push(`    extra_body=${pyLiteral(extra, 4)},`);
  const show = body.stream
    ? "for chunk in response:\n    print(chunk.model_dump_json())\n"
    : "print(response.model_dump_json(indent=2))\n";
  return `${withKey ? "import os\n\n" : ""}from openai import OpenAI\n\n` +
    `client = OpenAI(base_url="${origin}/v1", api_key=${key})\n` +
    `response = client.${SDK_METHOD[request.path]}.create(\n${args.join("\n")}\n)\n${show}`;
}

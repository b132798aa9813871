// Usage: node dialects.mjs BASE_URL API_KEY [QUESTION [MAX_TOKENS]]
// BASE_URL ends in /v1 (the openai client's base); the Anthropic SDK appends /v1/messages itself,
// so it gets the server's root. Runs OpenAI's Responses API through the openai npm package and
// Anthropic's Messages API through @anthropic-ai/sdk, each plain and streamed, at the server's
// default temperature, and prints one JSON object for tests/test_node_dialects.py to check.
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";

const [baseURL, apiKey, question = "What is the capital of France?", maxTokensArg = "24"] = process.argv.slice(2);
const maxTokens = Number(maxTokensArg);
const rootURL = baseURL.replace(/\/v1\/?$/, "");
const out = {};

// -- OpenAI's Responses API

function outputText(response) {
  // The client adds `output_text`; the items are read when a version does not.
  if (typeof response.output_text === "string") return response.output_text;
  return response.output
    .filter((item) => item.type === "message")
    .flatMap((item) => item.content)
    .filter((part) => part.type === "output_text")
    .map((part) => part.text)
    .join("");
}

const openai = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 300000 });
const request = { model: "local", input: question, max_output_tokens: maxTokens };

const plain = await openai.responses.create(request);
out.responses = { text: outputText(plain), status: plain.status, id: plain.id,
                  output_tokens: plain.usage?.output_tokens ?? null };

let streamed = "";
const types = [];
let completed = null;
const stream = await openai.responses.create({ ...request, stream: true });
for await (const event of stream) {
  types.push(event.type);
  if (event.type === "response.output_text.delta") streamed += event.delta;
  if (event.type === "response.completed" || event.type === "response.incomplete") completed = event.response;
}
out.responses_stream = { text: streamed, first: types[0] ?? null, last: types[types.length - 1] ?? null,
                         final_text: completed ? outputText(completed) : null };

// -- Anthropic's Messages API

function blockText(message) {
  return message.content.filter((block) => block.type === "text").map((block) => block.text).join("");
}

const anthropic = new Anthropic({ baseURL: rootURL, apiKey, maxRetries: 0, timeout: 300000 });
const messageRequest = { model: "local", max_tokens: maxTokens, messages: [{ role: "user", content: question }] };

const message = await anthropic.messages.create(messageRequest);
out.messages = { text: blockText(message), stop_reason: message.stop_reason, id: message.id,
                 output_tokens: message.usage?.output_tokens ?? null };

let deltas = "";
const messageStream = anthropic.messages.stream(messageRequest);
messageStream.on("text", (text) => { deltas += text; });
const final = await messageStream.finalMessage();
out.messages_stream = { text: blockText(final), deltas, stop_reason: final.stop_reason };

console.log(JSON.stringify(out));

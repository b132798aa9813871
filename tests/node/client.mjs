// Usage: node client.mjs BASE_URL API_KEY
// Runs chat and completions, plain and streamed, through the openai npm package and prints one
// JSON object with what came back, for the Python test to check.
import OpenAI from "openai";

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120000 });
const messages = [{ role: "user", content: "What is the capital of France?" }];
const out = {};

const chat = await client.chat.completions.create({ model: "local", messages, max_tokens: 12, temperature: 0 });
out.chat = { object: chat.object, content: chat.choices[0].message.content, finish_reason: chat.choices[0].finish_reason,
             usage: chat.usage };

let streamed = "";
let usage = null;
const stream = await client.chat.completions.create({ model: "local", messages, max_tokens: 12, temperature: 0,
                                                      stream: true, stream_options: { include_usage: true } });
for await (const chunk of stream) {
  if (chunk.choices.length) streamed += chunk.choices[0].delta.content ?? "";
  if (chunk.usage) usage = chunk.usage;
}
out.chat_stream = { content: streamed, usage };

const completion = await client.completions.create({ model: "local", prompt: "The capital of France is", max_tokens: 8, temperature: 0 });
out.completion = { object: completion.object, text: completion.choices[0].text, finish_reason: completion.choices[0].finish_reason };

let text = "";
for await (const chunk of await client.completions.create({ model: "local", prompt: "The capital of France is", max_tokens: 8,
                                                            temperature: 0, stream: true })) {
  text += chunk.choices[0]?.text ?? "";
}
out.completion_stream = { text };

const models = await client.models.list();
out.models = models.data.map((m) => m.id);

try {
  await new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 }).models.list();
  out.wrong_key = "accepted";
} catch (e) {
  out.wrong_key = e.status;
}

console.log(JSON.stringify(out));

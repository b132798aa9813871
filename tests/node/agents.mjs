// Usage: node agents.mjs BASE_URL
// Structured output and tool calls through the openai npm package and the Vercel AI SDK; prints
// one JSON object with what came back, for tests/test_agent_clients.py to check.
import OpenAI from "openai";
import { generateObject, generateText, tool } from "ai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { z } from "zod";

const [baseURL] = process.argv.slice(2);
const out = {};
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 300000 });
const capital = {
  type: "object", additionalProperties: false, required: ["capital", "country"],
  properties: { capital: { type: "string", maxLength: 30 }, country: { type: "string", maxLength: 30 } },
};
const ask = [{ role: "user", content: "Name the capital of France and its country." }];
const structured = await client.chat.completions.create({
  model: "local", messages: ask, max_tokens: 80, temperature: 0,
  response_format: { type: "json_schema", json_schema: { name: "capital", schema: capital } },
});
out.structured = { content: structured.choices[0].message.content, finish_reason: structured.choices[0].finish_reason };

const weather = {
  type: "function", function: {
    name: "get_weather", description: "The weather now in a city",
    parameters: { type: "object", additionalProperties: false, required: ["city"],
                  properties: { city: { type: "string", maxLength: 30 } } },
  },
};
const messages = [{ role: "user", content: "What is the weather in Paris?" }];
const request = { model: "local", messages, tools: [weather], tool_choice: "required", max_tokens: 80, seed: 4,
                  temperature: 0.8 };
const first = await client.chat.completions.create(request);
out.first = first.choices[0];
const call = first.choices[0].message.tool_calls[0];
const second = await client.chat.completions.create({
  model: "local", tools: [weather], max_tokens: 30,
  messages: [...messages, first.choices[0].message, { role: "tool", tool_call_id: call.id, content: "18 degrees and sunny" }],
});
out.second = { finish_reason: second.choices[0].finish_reason, prompt_tokens: second.usage.prompt_tokens,
               first_prompt_tokens: first.usage.prompt_tokens };
const streamed = {};
let streamedFinish = null;
for await (const chunk of await client.chat.completions.create({ ...request, stream: true })) {
  const choice = chunk.choices[0];
  if (!choice) continue;
  for (const part of choice.delta.tool_calls ?? []) {
    const entry = (streamed[part.index] ??= { name: "", arguments: "" });
    entry.name += part.function?.name ?? "";
    entry.arguments += part.function?.arguments ?? "";
  }
  streamedFinish = choice.finish_reason ?? streamedFinish;
}
out.streamed = { calls: Object.values(streamed), finish_reason: streamedFinish };

const provider = createOpenAICompatible({ name: "krafla", baseURL, apiKey: "none", supportsStructuredOutputs: true });
const { object } = await generateObject({
  model: provider("local"), prompt: "Name the capital of France and its country.", temperature: 0,
  maxOutputTokens: 80, maxRetries: 0,
  schema: z.object({ capital: z.string().max(30), country: z.string().max(30) }),
});
out.object = object;
const executed = [];
const result = await generateText({
  model: provider("local"), prompt: "What is the weather in Paris?", toolChoice: "required", temperature: 0,
  maxOutputTokens: 80, maxRetries: 0,
  tools: {
    get_weather: tool({
      description: "The weather now in a city",
      inputSchema: z.object({ city: z.string().max(30) }),
      execute: async ({ city }) => { executed.push(city); return "18 degrees and sunny"; },
    }),
  },
});
out.ai_tools = { calls: result.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
                 results: result.toolResults.map((r) => r.output), executed };
console.log(JSON.stringify(out));

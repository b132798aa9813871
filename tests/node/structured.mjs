// Usage: node structured.mjs BASE_URL
// The Vercel AI SDK's structured modes through @ai-sdk/openai-compatible, as a new user writes
// them: generateObject with supportsStructuredOutputs (response_format json_schema) and without
// (json_object, the schema left out), generateText with a tool the model may call (toolChoice
// auto) and must call (required). Prints one JSON object for tests/test_client_structured.py.
import { generateObject, generateText, stepCountIs, tool } from "ai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { z } from "zod";

const [baseURL] = process.argv.slice(2);
const out = {};
const schema = z.object({ capital: z.string(), country: z.string() });
const settings = { temperature: 0, maxOutputTokens: 60, maxRetries: 0 };

async function attempt(run) {
  try {
    return { ok: true, value: await run() };
  } catch (e) {
    return { ok: false, error: `${e.name}: ${e.message}`.slice(0, 300), text: e.text ?? null };
  }
}

for (const structured of [true, false]) {
  const provider = createOpenAICompatible({ name: "krafla", baseURL, apiKey: "none",
                                            supportsStructuredOutputs: structured });
  out[structured ? "object_json_schema" : "object_json_object"] = await attempt(async () => {
    const { object } = await generateObject({ model: provider("local"), schema, ...settings,
                                              prompt: "Name the capital of France and its country." });
    return object;
  });
}

const provider = createOpenAICompatible({ name: "krafla", baseURL, apiKey: "none" });
for (const toolChoice of ["auto", "required"]) {
  const executed = [];
  out[`tools_${toolChoice}`] = await attempt(async () => {
    const result = await generateText({
      model: provider("local"), prompt: "What is the weather in Paris?", toolChoice, ...settings,
      stopWhen: stepCountIs(toolChoice === "auto" ? 2 : 1),
      tools: {
        get_weather: tool({
          description: "The weather now in a city",
          inputSchema: z.object({ city: z.string() }),
          execute: async ({ city }) => { executed.push(city); return "18 degrees and sunny"; },
        }),
      },
    });
    return { calls: result.steps.flatMap((s) => s.toolCalls.map((c) => ({ name: c.toolName, input: c.input }))),
             results: result.steps.flatMap((s) => s.toolResults.map((r) => r.output)), executed,
             text: result.text, steps: result.steps.length };
  });
}
console.log(JSON.stringify(out));

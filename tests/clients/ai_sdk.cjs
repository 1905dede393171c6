// The Vercel AI SDK against a localrt server, as a JavaScript app uses it: its Ollama provider
// (ollama-ai-provider-v2, /api/chat and /api/embed) and @ai-sdk/openai-compatible (/v1). For each provider:
// generateText, streamText, maxOutputTokens 64 on a long answer, a tool call with toolChoice 'required'
// (and maxOutputTokens 64), and embed. Prints one JSON line: {provider: {job: what it returned}}.
//
//   NODE_PATH=<prefix>/node_modules node ai_sdk.cjs URL MODEL TOOLS_MODEL
"use strict";
const { generateText, streamText, embed, tool, jsonSchema } = require("ai");
const { createOllama } = require("ollama-ai-provider-v2");
const { createOpenAICompatible } = require("@ai-sdk/openai-compatible");

const [url, model, toolsModel] = process.argv.slice(2);
const QUESTION = "What is the capital of France?";
const LONG = "Count from 1 to 500, one number per line.";

async function jobs(chat, embedding) {
  const greedy = { temperature: 0, maxRetries: 0 };
  const generated = await generateText({ model: chat(model), prompt: QUESTION, maxOutputTokens: 24, ...greedy });
  const stream = streamText({ model: chat(model), prompt: QUESTION, maxOutputTokens: 24, ...greedy });
  let streamed = "";
  let chunks = 0;
  for await (const piece of stream.textStream) {
    streamed += piece;
    chunks += 1;
  }
  const limited = await generateText({ model: chat(model), prompt: LONG, maxOutputTokens: 64, ...greedy });
  const weather = tool({
    description: "Get the current weather for a city",
    inputSchema: jsonSchema({
      type: "object",
      properties: { city: { type: "string" } },
      required: ["city"],
    }),
  });
  const called = await generateText({
    model: chat(toolsModel),
    prompt: "What is the weather in Paris?",
    tools: { get_weather: weather },
    toolChoice: "required",
    maxOutputTokens: 64,
    ...greedy,
  });
  const vector = await embed({ model: embedding(model), value: "The cat sat on the mat.", maxRetries: 0 });
  return {
    generate: { text: generated.text, finishReason: generated.finishReason },
    stream: { text: streamed, chunks, finishReason: await stream.finishReason },
    limited: { outputTokens: limited.usage.outputTokens, finishReason: limited.finishReason },
    tool: {
      toolCalls: called.toolCalls.map((c) => ({ toolName: c.toolName, input: c.input })),
      text: called.text,
      outputTokens: called.usage.outputTokens,
      finishReason: called.finishReason,
    },
    embed: { dimensions: vector.embedding.length, tokens: vector.usage.tokens },
  };
}

async function main() {
  const ollama = createOllama({ baseURL: `${url}/api` });
  const compatible = createOpenAICompatible({
    name: "localrt",
    baseURL: `${url}/v1`,
    apiKey: "unused",
    includeUsage: true,
  });
  const report = {
    ollama: await jobs(
      (id) => ollama(id),
      (id) => ollama.embedding(id),
    ),
    "openai-compatible": await jobs(
      (id) => compatible.chatModel(id),
      (id) => compatible.embeddingModel(id),
    ),
  };
  console.log(JSON.stringify(report));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});

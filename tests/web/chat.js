// Streams a chat reply from a krafla server with fetch and a ReadableStream reader.
// With ?api=URL&message=TEXT&report=1 it runs once on load and POSTs what happened to /result on
// its own origin (this is how tests/test_browser.py reads the outcome from headless Chromium).

async function streamChat(api, key, message, onText) {
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(api + "/chat/completions", {
    method: "POST",
    headers,
    body: JSON.stringify({ messages: [{ role: "user", content: message }], max_tokens: 16, temperature: 0, stream: true }),
  });
  const outcome = { status: response.status, reads: 0, events: 0, done: false, text: "" };
  if (!response.ok) {
    outcome.error = await response.text();
    return outcome;
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    outcome.reads += 1;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!block.startsWith("data: ")) continue;
      const data = block.slice(6);
      outcome.events += 1;
      if (data === "[DONE]") {
        outcome.done = true;
        continue;
      }
      const chunk = JSON.parse(data);
      const piece = chunk.choices && chunk.choices.length ? chunk.choices[0].delta.content || "" : "";
      outcome.text += piece;
      onText(piece);
    }
  }
  return outcome;
}

const $ = (id) => document.getElementById(id);

async function send() {
  $("reply").textContent = "";
  let outcome;
  try {
    outcome = await streamChat($("api").value, $("key").value, $("message").value, (piece) => {
      $("reply").textContent += piece;
    });
  } catch (e) {
    // A server that does not allow this origin: the browser blocks the read and fetch rejects.
    outcome = { error: String(e), blocked: e instanceof TypeError };
    $("reply").textContent = "Error: " + e;
  }
  return outcome;
}

$("send").addEventListener("click", send);

const params = new URLSearchParams(location.search);
if (params.has("api")) $("api").value = params.get("api");
if (params.has("message")) $("message").value = params.get("message");
if (params.get("report") === "1") {
  send().then((outcome) => fetch("/result", { method: "POST", body: JSON.stringify(outcome) }));
}

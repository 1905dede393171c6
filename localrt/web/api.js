// The server's public HTTP API, as any client uses it: same origin, the API key (when the server has
// one) as `Authorization: Bearer`, and NDJSON streams read line by line.

const KEY = "localrt.apiKey";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let askKey = null; // set by the app: (refused: boolean) => Promise<string | null>
let asking = null; // one prompt at a time, however many requests were refused together

export function onUnauthorized(ask) {
  askKey = ask;
}

export function apiKey() {
  return localStorage.getItem(KEY) || "";
}

function keyAfterRefusal(sent) {
  if (!asking) {
    asking = askKey(Boolean(sent)).finally(() => {
      asking = null;
    });
  }
  return asking;
}

export async function request(path, { method = "GET", body, signal } = {}) {
  for (;;) {
    const headers = {};
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const sent = apiKey();
    if (sent) headers.Authorization = `Bearer ${sent}`;
    const res = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      credentials: "same-origin",
      cache: "no-store",
    });
    if (res.status === 401 && askKey) {
      if (apiKey() !== sent) continue; // another request's prompt already got a new key
      const key = await keyAfterRefusal(sent);
      if (key) {
        localStorage.setItem(KEY, key);
        continue;
      }
    }
    if (!res.ok) throw new ApiError(res.status, await errorText(res));
    return res;
  }
}

async function errorText(res) {
  try {
    const body = await res.json();
    const error = body.error;
    return (typeof error === "string" ? error : error?.message) || res.statusText;
  } catch {
    return res.statusText || `HTTP ${res.status}`;
  }
}

export async function json(path, options) {
  return (await request(path, options)).json();
}

// Each line of an NDJSON answer as an object; an {"error"} line in the stream is thrown.
export async function* ndjson(path, options) {
  const res = await request(path, options);
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  const parse = (line) => {
    const item = JSON.parse(line);
    if (item.error) throw new ApiError(500, item.error);
    return item;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (line) yield parse(line);
    }
  }
  if (buffer.trim()) yield parse(buffer.trim());
}

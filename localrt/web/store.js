// Conversations, kept in this browser's IndexedDB (nothing is stored on the server).

const DB = "localrt";
const STORE = "conversations";
let opened = null;

function db() {
  opened ??= new Promise((resolve, reject) => {
    const req = indexedDB.open(DB, 1);
    req.onupgradeneeded = () => req.result.createObjectStore(STORE, { keyPath: "id" });
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
  return opened;
}

async function run(mode, work) {
  const d = await db();
  return new Promise((resolve, reject) => {
    const tx = d.transaction(STORE, mode);
    const req = work(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(req.result);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error);
  });
}

export async function list() {
  const all = await run("readonly", (s) => s.getAll());
  return all.sort((a, b) => b.updated - a.updated);
}

export const get = (id) => run("readonly", (s) => s.get(id));
export const put = (conversation) => run("readwrite", (s) => s.put(conversation));
export const remove = (id) => run("readwrite", (s) => s.delete(id));

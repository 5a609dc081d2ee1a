// Preloaded into every Bun script the sandbox runs: process.stdout/stderr.write
// become synchronous, so process.exit() right after a large write cannot drop
// output still queued in Bun (console.log is synchronous already).
const fs = require("node:fs");
for (const [stream, fd] of [[process.stdout, 1], [process.stderr, 2]]) {
  stream.write = function (chunk, encoding, callback) {
    if (typeof encoding === "function") { callback = encoding; encoding = undefined; }
    let buffer = typeof chunk === "string"
      ? Buffer.from(chunk, encoding)
      : Buffer.from(chunk.buffer ?? chunk, chunk.byteOffset, chunk.byteLength);
    while (buffer.length) {
      try { buffer = buffer.subarray(fs.writeSync(fd, buffer)); }
      catch (error) { if (error.code === "EAGAIN") { Bun.sleepSync(1); continue; } throw error; }
    }
    if (callback) queueMicrotask(callback);
    return true;
  };
}

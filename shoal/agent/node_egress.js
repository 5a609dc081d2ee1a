// Node's fetch through the sandbox's egress proxy (NODE_OPTIONS --require, set
// only where the host grants egress). Node 20's built-in fetch ignores
// HTTP(S)_PROXY; undici (pinned in runtime/node-packages.txt) shares its global
// dispatcher, and EnvHttpProxyAgent reads HTTP(S)_PROXY and NO_PROXY as curl does.
"use strict";
try {
  const { setGlobalDispatcher, EnvHttpProxyAgent } = require("/opt/shoal/runtime/node_modules/undici");
  const warn = process.emitWarning;
  process.emitWarning = () => {};  // "EnvHttpProxyAgent is experimental": not the user's concern
  try {
    setGlobalDispatcher(new EnvHttpProxyAgent());
  } finally {
    process.emitWarning = warn;
  }
} catch (error) {
  // Without it fetch simply has no way out; code that sets its own agent still works.
}

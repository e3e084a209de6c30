"""The OpenAI-compatible HTTP surface: routes, request bodies, errors, SSE and the response
writer, the admission gate, the backend protocol the upstream implements."""

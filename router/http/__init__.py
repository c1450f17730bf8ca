"""The HTTP edge's primitives: errors, responses, SSE, request parsing, security, the h11 server, the access log."""

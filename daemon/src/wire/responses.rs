//! The OpenAI Responses API (`POST /v1/responses`), to be served by translation as the
//! Messages API is: [`request`] rewrites a Responses request into the chat body every source
//! and detector already governs (docs/wire-format.md, "Responses API requests"). The encoder
//! of what the client reads in the Responses schema, and the route, are still to come: the
//! surface layer refuses `/v1/responses` until they are.

pub mod request;

"""Wire messages: msgspec Structs, one module per protocol."""

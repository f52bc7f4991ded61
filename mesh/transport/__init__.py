"""The CPU transports under the collectives: direct point-to-point collectives, shared-memory rings, staging through host copies, output buffer reuse."""

"""Unit tier: no server of any kind (no JVM, no Redis), the whole folder in well under 30 s."""

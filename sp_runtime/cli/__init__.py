"""Command-line tools: demo, bench, doctor, client."""

from fp8rl.cli import app

app()

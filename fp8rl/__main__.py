from fp8rl.entry import main

main()

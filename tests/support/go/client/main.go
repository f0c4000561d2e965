// A Go client of encoderd's gRPC API, on stubs that protoc-gen-go and protoc-gen-go-grpc generate
// from protos/encoderd/v1 (tests/integration/test_go_client.py builds and runs it). It reads what
// to send as JSON on stdin and writes what came back as JSON on stdout; the test compares that
// with the Python client's answers from the same server.
package main

import (
	"context"
	"encoding/json"
	"io"
	"log"
	"os"
	"time"

	pb "github.com/encoderd/encoderd/gen/go/encoderd/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

type request struct {
	Address  string   `json:"address"`
	Embedder string   `json:"embedder"`
	Reranker string   `json:"reranker"`
	Texts    []string `json:"texts"`
	Query    string   `json:"query"`
}

type streamAnswer struct {
	ID           string    `json:"id"`
	Values       []float32 `json:"values"`
	PromptTokens int32     `json:"prompt_tokens"`
	ErrorCode    int32     `json:"error_code"`
}

type answers struct {
	Models       map[string]string `json:"models"` // id -> kind
	Vectors      [][]float32       `json:"vectors"`
	PromptTokens int32             `json:"prompt_tokens"`
	Int8         []byte            `json:"int8"`
	Stream       []streamAnswer    `json:"stream"`
	Rerank       map[int32]float32 `json:"rerank"` // document index -> score
	Errors       map[string]string `json:"errors"` // call -> gRPC status code name
}

func main() {
	var in request
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		log.Fatalf("stdin: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, in.Address, grpc.WithInsecure(), grpc.WithBlock())
	check(err, "dial")
	defer conn.Close()
	client := pb.NewEncoderClient(conn)
	out := answers{Models: map[string]string{}, Rerank: map[int32]float32{}, Errors: map[string]string{}}

	models, err := client.ListModels(ctx, &pb.ListModelsRequest{})
	check(err, "ListModels")
	for _, m := range models.Models {
		out.Models[m.Id] = m.Kind
	}

	embedded, err := client.Embed(ctx, &pb.EmbedRequest{Model: in.Embedder, Inputs: in.Texts})
	check(err, "Embed")
	for _, e := range embedded.Embeddings {
		out.Vectors = append(out.Vectors, e.Values)
	}
	out.PromptTokens = embedded.Usage.GetPromptTokens()

	// An optional field and an enum: normalize off, int8 out.
	off := false
	packed, err := client.Embed(ctx, &pb.EmbedRequest{
		Model: in.Embedder, Inputs: in.Texts[:1], Normalize: &off, OutputDtype: pb.OutputDtype_OUTPUT_DTYPE_INT8,
	})
	check(err, "Embed int8")
	out.Int8 = packed.Embeddings[0].Data

	out.Stream = stream(ctx, client, in)

	ranked, err := client.Rerank(ctx, &pb.RerankRequest{Model: in.Reranker, Query: in.Query, Documents: in.Texts})
	check(err, "Rerank")
	for _, r := range ranked.Results {
		out.Rerank[r.Index] = r.RelevanceScore
	}

	// Calls that must fail, with the status the API documents.
	_, err = client.Embed(ctx, &pb.EmbedRequest{Model: "no-such-model", Inputs: in.Texts[:1]})
	out.Errors["unknown_model"] = status.Code(err).String()
	_, err = client.Rerank(ctx, &pb.RerankRequest{Model: in.Embedder, Query: in.Query, Documents: in.Texts})
	out.Errors["rerank_on_embedder"] = status.Code(err).String()

	check(json.NewEncoder(os.Stdout).Encode(out), "stdout")
}

// stream sends every text and one empty input on one EmbedStream, then reads every answer.
func stream(ctx context.Context, client pb.EncoderClient, in request) []streamAnswer {
	calls, err := client.EmbedStream(ctx)
	check(err, "EmbedStream")
	for i, text := range append(append([]string{}, in.Texts...), "") {
		first := i == 0
		message := &pb.EmbedStreamRequest{Id: string(rune('a' + i)), Input: text}
		if first {
			message.Model = in.Embedder
		}
		check(calls.Send(message), "EmbedStream send")
	}
	check(calls.CloseSend(), "EmbedStream close")
	var got []streamAnswer
	for {
		answer, err := calls.Recv()
		if err == io.EOF {
			return got
		}
		check(err, "EmbedStream receive")
		one := streamAnswer{ID: answer.Id, PromptTokens: answer.PromptTokens, ErrorCode: answer.Error.GetCode()}
		if answer.Embedding != nil {
			one.Values = answer.Embedding.Values
		}
		got = append(got, one)
	}
}

func check(err error, what string) {
	if err != nil {
		log.Fatalf("%s: %v (%s)", what, err, status.Code(err))
	}
}
